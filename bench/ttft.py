"""What lmspd adds to the time to first token, and where it goes.

    python -m bench.ttft [--runs 15] [--words 8] [--model-dir DIR]

Alternates one raw ``stream_generate`` (bench/raw.py: same BLAS, weights and prompt, in a
child process) with one streamed ``/v1/responses`` request to ``lmspd serve`` (the openai
SDK; the prompt cache off, so each request prefills the whole prompt as the raw call does),
and prints the medians, the overhead (lmspd's median minus raw's, and the median of the
paired differences), and the server's own account of each stage from
``lmspd_first_token_stage_seconds`` (mean per request).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from bench.raw import Raw
from harness.server import free_port, kill, spawn
from lmspd.config import load_config
from lmspd.metrics import STAGES
from lmspd.models.registry import ModelRegistry

SYSTEM = "You are a helpful assistant. Answer in full sentences."


def stage_sums(port: int) -> dict[str, tuple[float, float]]:
    """Each stage's (sum of seconds, count) so far."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "lmspd_first_token_stage_seconds":
            continue
        for s in family.samples:
            total, count = out.get(s.labels["stage"], (0.0, 0.0))
            if s.name.endswith("_sum"):
                out[s.labels["stage"]] = (s.value, count)
            elif s.name.endswith("_count"):
                out[s.labels["stage"]] = (total, s.value)
    return out


def lmspd_ttft(client: OpenAI, prompt: str) -> tuple[float, int]:
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    stream = client.responses.create(
        model="bench", instructions=SYSTEM, input=prompt, max_output_tokens=2, temperature=0, stream=True
    )
    for event in stream:
        if event.type == "response.output_text.delta" and not first:
            first = time.perf_counter() - start
        elif event.type in ("response.completed", "response.incomplete"):
            usage = event.response.usage
            tokens = usage.input_tokens if usage else 0
    return first, tokens


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--words", type=int, default=8, help="filler words added to the user prompt")
    parser.add_argument("--dtype", default="quantized_float32")
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    config = load_config()
    model_dir = (args.model_dir or ModelRegistry(config).resolve(config.default_model).path).resolve()
    prompt = "Name one colour. " + "Please answer briefly. " * (args.words // 3)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    raw = Raw(model_dir, args.dtype)
    with tempfile.TemporaryDirectory(prefix="lmspd-ttft-") as tmp:
        data = Path(tmp)
        (data / "lmspd.toml").write_text(f'[models.bench]\npath = "{model_dir}"\n')
        port = free_port()
        cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(data / "lmspd.toml")]
        cmd += ["--port", str(port), "--model", "bench", "--data-dir", str(data / "db")]
        env = {"LMSPD_PROMPT_CACHE_MAX_BYTES": "0", "LMSPD_WEIGHT_DTYPE": args.dtype}
        os.environ.update(env)
        proc = spawn(cmd, f"http://127.0.0.1:{port}/readyz", data / "lmspd.log")
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            raw.ttft(messages)  # warm-up: the first call of each compiles and allocates
            lmspd_ttft(client, prompt)
            before = stage_sums(port)
            raws: list[float] = []
            ours: list[float] = []
            for _ in range(args.runs):
                seconds, raw_tokens = raw.ttft(messages)
                raws.append(seconds)
                time.sleep(0.3)  # the raw process's BLAS threads go idle first
                seconds, our_tokens = lmspd_ttft(client, prompt)
                ours.append(seconds)
                time.sleep(0.3)
            after = stage_sums(port)
        finally:
            kill(proc)
            raw.close()
    if raw_tokens != our_tokens:
        print(f"note: raw prompt {raw_tokens} tokens, lmspd's {our_tokens}")
    print(f"\nmodel {model_dir}, {args.dtype} weights, {os.cpu_count()} CPUs")
    print(f"{raw_tokens}-token prompt, {args.runs} runs each, alternating")
    paired = statistics.median(o - r for o, r in zip(ours, raws, strict=True))
    print("\n| | p50 | min | max |\n|---|---|---|---|")
    for name, runs in (("raw stream_generate", raws), ("lmspd, /v1/responses stream", ours)):
        print(f"| {name} | {ms(statistics.median(runs))} | {ms(min(runs))} | {ms(max(runs))} |")
    overhead = statistics.median(ours) - statistics.median(raws)
    print(f"\noverhead: p50 difference {ms(overhead)}; median of paired differences {ms(paired)}")
    print("\n| stage (server's account) | mean ms |\n|---|---|")
    for stage in STAGES:
        total, count = (a - b for a, b in zip(after.get(stage, (0, 0)), before.get(stage, (0, 0)), strict=True))
        print(f"| {stage} | {total / count * 1e3:.1f} |" if count else f"| {stage} | - |")
    print(f"| (raw stream_generate, for the engine stage) | {statistics.fmean(raws) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
