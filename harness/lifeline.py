"""How soon the engine dies with its server: ``kill -9`` of ``lmspd serve`` in the middle of a
long prefill step, against how long that prefill takes.

    python -m harness.lifeline [--runs 1]

One ``lmspd serve`` per run on the bundled model with quantized weights (pulled into the
tests' cache), whose prefill of a prompt of some hundred tokens holds the engine's main
thread in MLX calls for seconds. Each run times that prompt's prefill once (a one-token
answer, the prompt cache off), then submits it again for a long answer, kills the server
once the task runs, and times until the engine process is gone. Prints both and their ratio:
near 0 when the lifeline ends the engine at once (the kernel's parent-death signal, or its
watch thread), near 1 or more when the engine is left to read the pipe's EOF once its step
ends. It asserts nothing: this was a test's ``gone within 2 s`` (tests/system/
test_engine_lifeline.py), a timing that passes or fails by the machine; the test keeps how
the engine ends (by its lifeline, not by the EOF after its step).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness.server import kill, serve

ROOT = Path(__file__).resolve().parent.parent
TEST_CACHE = Path(os.environ.get("LMSPD_TEST_CACHE", ROOT / ".test-cache"))
PROMPT = "Summarise this: " + " ".join(f"item {i} is a dragon of colour {i * 7 % 13}." for i in range(80))


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def engine_of(server: int) -> int:
    """The engine process a server spawned (multiprocessing's ``spawn_main``)."""
    [engine] = [child for child in children(server) if "spawn_main" in cmdline(child)]
    return engine


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes is not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def bundled_model() -> Path:
    from lmspd.models.catalog import BUILTIN_MODELS
    from lmspd.models.pull import pull_builtin

    return pull_builtin(BUILTIN_MODELS["smollm2-135m-instruct"], TEST_CACHE / "models")


def one_run(work: Path, model: Path) -> tuple[float, float]:
    """(the prompt's prefill, seconds from the kill until the engine was gone)."""
    server, url = serve(
        work,
        f'default_model = "smol"\n[engine]\nweight_dtype = "quantized"\nprompt_cache_max_bytes = 0\n'
        f'[server]\ndata_dir = "{work / "data"}"\n[models.smol]\npath = "{model}"\n',
    )
    engine = engine_of(server.pid)
    try:
        with httpx.Client(base_url=url, timeout=300) as http:
            http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1}).raise_for_status()  # loaded
            started = time.perf_counter()
            http.post("/v1/responses", json={"input": PROMPT, "max_output_tokens": 1, "temperature": 0})
            prefill = time.perf_counter() - started
            body = {"type": "response", "on_restart": "fail", "input": {"input": PROMPT, "max_output_tokens": 3000}}
            task = http.post("/lmsp/v1/tasks", json=body).json()
            deadline = time.monotonic() + 60
            while http.get(f"/lmsp/v1/tasks/{task['id']}").json()["status"] != "running":
                if time.monotonic() > deadline:
                    raise RuntimeError("the task never started")
                time.sleep(0.02)
        os.kill(server.pid, signal.SIGKILL)  # the server only: the engine is in its process group
        killed = time.perf_counter()
        server.wait(10)
        while alive(engine) and time.perf_counter() - killed < 120:
            time.sleep(0.005)
        return prefill, time.perf_counter() - killed
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGKILL)
        if server.poll() is None:
            kill(server, signal.SIGKILL)


def line(prefill: float, gone: float) -> str:
    return f"prefill {prefill:.2f}s, engine gone {gone:.3f}s after the kill, ratio {gone / prefill:.4f}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1, help="servers started and killed (a minute or more each)")
    args = parser.parse_args()
    model = bundled_model()
    rows = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="lmspd-lifeline-") as tmp:
            prefill, gone = one_run(Path(tmp), model)
        rows.append((prefill, gone))
        print(
            f"run {i + 1}: prefill {prefill:.2f}s, engine gone {gone:.3f}s after the kill, ratio {gone / prefill:.3f}"
        )
    prefill, gone = (statistics.median(column) for column in zip(*rows, strict=True))
    print(f"median: prefill {prefill:.2f}s, engine gone {gone:.3f}s after the kill, ratio {gone / prefill:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
