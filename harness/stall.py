"""Whether a long prompt stalls other clients (issue 12): health-check latency while one
client sends a prompt too long to serve, against the same probes on the idle server.

    python -m harness.stall [--repeat 3]

One ``lmspd serve`` on the tests' tiny random-weight model (4096-token context, one engine
slot). For each route that takes a prompt and two sizes, a 7.2 MB prompt (refused by its
size) and a 320 kB one (could fit by its size: tokenized to learn it does not), one client
posts the prompt while this process probes ``/lmsp/v1/healthz`` every 20 ms (at least five
probes). The server tokenizes where its event loop does not wait for it, and
refuses what cannot fit by its size before that; a stalled event loop delays every probe due
meanwhile. The probes run here, so the server's stall cannot delay the probes' own clock.

Prints, per route and size, the long request's time, the probes' median latency and its
ratio to the idle server's median (about 1 when nothing stalls). It asserts nothing: this
was a test's ``median < 0.1 s`` (tests/api/test_v1_compat.py), a timing that passes or fails
by the machine; the test keeps what the server answers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec

from harness.server import kill, serve

ROOT = Path(__file__).resolve().parent.parent
HUGE = "The quick brown fox jumps over the lazy dog. " * 160_000  # 7.2 MB: refused by its size
LARGE = HUGE[:320_000]  # could fit by its size: tokenized to learn it does not
LONG_ROUTES: list[tuple[str, Callable[[str], Any]]] = [
    ("/v1/responses", lambda text: {"input": text, "max_output_tokens": 2}),
    ("/v1/responses/input_tokens", lambda text: {"input": text}),
    ("/v1/responses/compact", lambda text: {"input": text}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
    ("/lmsp/v1/tasks", lambda text: {"type": "response", "input": {"input": text, "max_output_tokens": 2}}),
    ("/lmsp/v1/responses", lambda text: {"input": text, "max_output_tokens": 2}),
]


def tiny_model(dest: Path) -> Path:
    """The tests' tiny random-weight model with a 4096-token context (harness/models.py)."""
    from harness.models import CACHE, SMOL, make_tiny_model
    from lmspd.models.pull import pull_builtin

    smol = pull_builtin(SMOL, CACHE / "models")  # instant once the test suite has pulled it
    return make_tiny_model(dest, smol, seed=0, context=4096)


def probe_while(url: str, busy: Callable[[], bool]) -> list[float]:
    """Health-check latencies (seconds, from when each was due): one probe due every 20 ms
    while ``busy()``, at least five."""
    with httpx.Client(timeout=30) as http, ThreadPoolExecutor(8) as pool:  # one client: no setup per probe

        def probe(due: float) -> float:
            http.get(f"{url}/lmsp/v1/healthz").raise_for_status()
            return time.perf_counter() - due

        probes: list[Future[float]] = []
        while busy() or len(probes) < 5:
            probes.append(pool.submit(probe, time.perf_counter()))
            time.sleep(0.02)
        return [p.result() for p in probes]


def long_request(url: str, route: str, raw: bytes) -> tuple[float, list[float], int]:
    """The long request's seconds, the probes' latencies meanwhile, and its status code."""
    answers: list[httpx.Response] = []
    headers = {"Content-Type": "application/json"}
    busy = threading.Thread(
        target=lambda: answers.append(httpx.post(f"{url}{route}", content=raw, headers=headers, timeout=60))
    )
    started = time.perf_counter()
    busy.start()
    latencies = probe_while(url, busy.is_alive)
    busy.join()
    return time.perf_counter() - started, latencies, answers[0].status_code


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=1, help="long requests per route and size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmspd-stall-") as tmp:
        work = Path(tmp)
        model = tiny_model(work / "tiny")
        proc, url = serve(
            work,
            f'default_model = "tiny"\n[engine]\nweight_dtype = "quantized"\nmax_concurrency = 1\n'
            f'[server]\ndata_dir = "{work / "data"}"\nkeepalive_secs = 0.5\n[models.tiny]\npath = "{model}"\n',
        )
        try:
            until = time.perf_counter() + 1.0
            idle = statistics.median(probe_while(url, lambda: time.perf_counter() < until))
            print(f"stall: probes every 20 ms, idle server median {idle * 1000:.1f} ms")
            print(f"{'route':30} {'size':6} {'status':>6} {'request':>9} {'probes':>6} {'median':>9} {'ratio':>6}")
            for route, body in LONG_ROUTES:
                for size, text in (("huge", HUGE), ("large", LARGE)):
                    raw = msgspec.json.encode(body(text))
                    for _ in range(args.repeat):
                        took, latencies, status = long_request(url, route, raw)
                        median = statistics.median(latencies)
                        print(
                            f"{route:30} {size:6} {status:>6} {took:>8.2f}s {len(latencies):>6} "
                            f"{median * 1000:>7.1f}ms {median / idle:>6.1f}"
                        )
        finally:
            kill(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
