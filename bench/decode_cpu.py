"""Where a streamed answer's CPU goes: each lmspd process and thread, per token.

    python -m bench.decode_cpu [--model-dir DIR] [--tokens 300] [--rounds 3] [--streams 1]

Starts ``lmspd serve`` on the bundled model (or ``--model-dir``), streams greedy Chat Completions
answers of ``--tokens`` tokens (``--streams`` at once), and reads every thread's CPU time of the
server and its children from /proc before and after each round: milliseconds of CPU per token
generated, beside the wall time per token. On a machine with as many cores as the engine has
busy threads, CPU a token above the cores' share of its wall time is CPU the kernels wait for
(docs/benchmarks.md, "Sixth pass"). Threads are named by process (server, engine) and, in the
engine, the main thread (Python: graph construction, MLX's dispatch, the step loop) and the
others by CPU taken (MLX's stream thread and the kernels' helper do the products).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.peers import children, process_label
from bench.step_profile import default_model_dir, thread_cpu
from harness.server import kill, serve


def answer(client: httpx.Client, url: str, prompt: str, tokens: int) -> int:
    """Stream one greedy answer; the tokens it generated (its usage)."""
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    generated = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                generated = int(usage["completion_tokens"])
    return generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=1)
    args = parser.parse_args()
    model_dir = args.model_dir or default_model_dir()
    with tempfile.TemporaryDirectory(prefix="lmspd-decode-cpu-") as tmp:
        work = Path(tmp)
        proc, url = serve(work, f'[models.bench]\npath = "{model_dir}"\n[server]\ndata_dir = "{work}"\n')
        client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=2 * args.streams))
        try:
            answer(client, url, "Warm up.", 16)
            pids = [proc.pid, *children(proc.pid)]
            rows: dict[str, list[float]] = {}
            walls = []
            for round_no in range(args.rounds):
                before = {pid: thread_cpu(pid) for pid in pids}
                start = time.perf_counter()
                prompts = [
                    f"Write a very long story about a lighthouse, number {round_no}-{i}." for i in range(args.streams)
                ]
                with ThreadPoolExecutor(args.streams) as pool:
                    generated = sum(pool.map(lambda p: answer(client, url, p, args.tokens), prompts))
                wall = time.perf_counter() - start
                walls.append(wall * 1e3 / generated)
                for pid in pids:
                    label = process_label(pid, proc.pid)
                    spent = {t: s - before[pid].get(t, 0.0) for t, s in thread_cpu(pid).items()}
                    main_ms = spent.pop(pid, 0.0) * 1e3 / generated
                    others = sorted((s * 1e3 / generated for s in spent.values()), reverse=True)
                    rows.setdefault(f"{label}: all threads", []).append(main_ms + sum(others))
                    rows.setdefault(f"{label}: main thread", []).append(main_ms)
                    for rank, ms in enumerate(others[:3], 1):
                        rows.setdefault(f"{label}: thread {rank} by CPU", []).append(ms)
                print(f"round {round_no + 1}: {generated} tokens, {generated / wall:.1f} tok/s", flush=True)
        finally:
            client.close()
            kill(proc)
    cores = os.cpu_count() or 1
    wall_ms = statistics.median(walls)
    print(f"\n{args.streams} stream(s), {args.tokens} tokens each, medians of {args.rounds} rounds ({cores} CPUs)")
    print(f"  {'wall time per token':<40}{wall_ms:>8.2f} ms  (the CPUs hold {cores * wall_ms:.2f} ms of CPU)")
    for label, values in rows.items():
        if max(values) >= 0.05:
            print(f"  {label:<40}{statistics.median(values):>8.2f} ms CPU")


if __name__ == "__main__":
    main()
