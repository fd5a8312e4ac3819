"""A model's life on a real server: the first token of a request that finds its model unloaded
vs resident, and the engine's RSS over many mixed requests with and without recycling.

    python -m bench.lifecycle [--runs 10] [--requests 2000] [--recycle-every 500] [--model-dir DIR]

Both parts run ``lmspd serve`` on the default model (or ``--model-dir``). The first alternates
a streamed ``/v1/responses`` request to the resident model with one right after an operator's
unload (``POST /lmsp/v1/models/bench/unload``), so its time to first token includes the load.
The second sends ``--requests`` mixed requests (prompts of 5 to 120 words, 1 to 8 output
tokens, four clients, each with its own prompt cache key, so the prompt cache grows) and prints
the engine's RSS (``lmspd_engine_rss_bytes``) every 100, once without recycling and once with
an operator's recycle every ``--recycle-every`` requests.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.server import kill, serve
from lmspd.config import load_config
from lmspd.models.registry import ModelRegistry

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "its",
    "form",
]
CLIENTS = 4


def config_text(model_dir: Path, data: Path, dtype: str, prompt_cache: bool = True) -> str:
    return (
        f'default_model = "bench"\n[models.bench]\npath = "{model_dir}"\n'
        f'[engine]\nweight_dtype = "{dtype}"\nmax_concurrency = {CLIENTS}\n'
        + ("" if prompt_cache else "prompt_cache_max_bytes = 0\n")
        + f'[server]\ndata_dir = "{data}"\n'
    )


def ttft(client: httpx.Client, prompt: str) -> float:
    body = {"model": "bench", "input": prompt, "max_output_tokens": 2, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = 0.0
    with client.stream("POST", "/v1/responses", json=body) as r:
        for line in r.iter_lines():  # to its end: the model is idle again when this returns
            if not first and line.startswith("event: response.output_text.delta"):
                first = time.perf_counter() - start
    if not first:
        raise RuntimeError("no output token")
    return first


def engine_rss(client: httpx.Client) -> int:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "lmspd_engine_rss_bytes":
            return int(family.samples[0].value)
    return 0


def cold_and_warm(url: str, runs: int) -> tuple[list[float], list[float]]:
    warm: list[float] = []
    cold: list[float] = []
    with httpx.Client(base_url=url, timeout=300) as client:
        ttft(client, "Hello")  # the first request compiles and allocates
        for i in range(runs):
            warm.append(ttft(client, f"Name a colour ({i})."))
            client.post("/lmsp/v1/models/bench/unload").raise_for_status()
            cold.append(ttft(client, f"Name a fruit ({i})."))
    return cold, warm


def mixed(url: str, requests: int, recycle_every: int, seed: int = 0) -> list[tuple[int, int]]:
    """(requests done, engine RSS) every 100 requests."""
    rng = random.Random(seed)
    bodies = [
        {
            "model": "bench",
            "input": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))),
            "max_output_tokens": rng.randint(1, 8),
            "temperature": 0,
            "prompt_cache_key": f"client-{i % CLIENTS}",
            "store": False,
        }
        for i in range(requests)
    ]
    points: list[tuple[int, int]] = []
    with httpx.Client(base_url=url, timeout=300) as client, ThreadPoolExecutor(CLIENTS) as pool:
        for start in range(0, requests, 100):
            if recycle_every and start and start % recycle_every == 0:
                client.post("/lmsp/v1/engine/recycle").raise_for_status()
            answers = list(pool.map(lambda b: client.post("/v1/responses", json=b), bodies[start : start + 100]))
            failed = [a.status_code for a in answers if a.status_code != 200]
            if failed:
                raise RuntimeError(f"requests failed: {failed[:5]}")
            points.append((start + len(answers), engine_rss(client)))
    return points


def mib(n: float) -> str:
    return f"{n / 1024**2:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--recycle-every", type=int, default=500)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    # A SIGTERM (timeout(1), Ctrl-C's cousin) runs the finally blocks: no server is left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    config = load_config()
    model_dir = (args.model_dir or ModelRegistry(config).resolve(config.default_model).path).resolve()
    print(f"model {model_dir}, {args.dtype} weights, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="lmspd-lifecycle-") as tmp:
        work = Path(tmp)
        # No prompt cache here: each request prefills its whole prompt, loaded or not.
        proc, url = serve(work, config_text(model_dir, work / "db", args.dtype, prompt_cache=False))
        try:
            cold, warm = cold_and_warm(url, args.runs)
        finally:
            kill(proc)
        print(f"\ntime to first token, {args.runs} runs each, alternating\n")
        print("| model | p50 | min | max |\n|---|---|---|---|")
        for name, runs in (("resident", warm), ("unloaded (load + prefill)", cold)):
            p50, low, high = (statistics.median(runs), min(runs), max(runs))
            print(f"| {name} | {p50 * 1e3:.0f} ms | {low * 1e3:.0f} ms | {high * 1e3:.0f} ms |")
        series: dict[str, list[tuple[int, int]]] = {}
        for name, every in (("no recycling", 0), (f"recycle every {args.recycle_every}", args.recycle_every)):
            run = work / name.replace(" ", "-")
            run.mkdir()
            proc, url = serve(run, config_text(model_dir, run / "db", args.dtype))
            try:
                series[name] = mixed(url, args.requests, every)
            finally:
                kill(proc)
        names = list(series)
        print(f"\nengine RSS over {args.requests} mixed requests\n\n| requests | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for i, (done, _) in enumerate(series[names[0]]):
            print(f"| {done} | " + " | ".join(mib(series[n][i][1]) for n in names) + " |")


if __name__ == "__main__":
    main()
