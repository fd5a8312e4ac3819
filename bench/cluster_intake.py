"""Task intake on SQLite (one node) and on PostgreSQL with 1, 2 and 3 nodes, side by side in one run;
and the replay of a finished task's events (``Last-Event-ID``) on SQLite and on PostgreSQL.

    python -m bench.tasks --store postgresql://user@host/postgres [--clients 32] [--tasks 2000]
    python -m bench.tasks --store auto      # a PostgreSQL of its own (initdb/pg_ctl), fsync on

Each row starts that many real ``lmspd serve`` processes on one fresh database (on PostgreSQL each is
a node), spreads ``--clients`` concurrent HTTP clients over them round robin, and posts
``--tasks`` one-token tasks: accepted tasks/s and p50/p99 of one POST (202 = committed). The
default model serves; with ``--store URL`` the rows share that database, with ``auto`` each gets its own;
on one machine the nodes share its cores, so the rows say what the store costs, not what more
machines add (docs/operations.md, "Several nodes").

Replay, after the intake rows: one idle node on SQLite and one on PostgreSQL, up at once, each with
a finished task of ``--history`` events written through the store; each task is read back over
SSE with ``Last-Event-ID: 0`` (all but its first event), as a client resuming it would, the two
alternating ``REPLAYS`` times; events/s, the median of each. (With ``--store URL`` that node's
database is the URL's, where the intake rows may have left tasks queued: it runs them meanwhile.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.tasks import replay
from harness.history import seed_history
from harness.postgres import durable_cluster
from harness.server import free_port

BODY = {"type": "response", "input": {"input": "Hi", "max_output_tokens": 1}}


@contextlib.contextmanager
def nodes(tmp: Path, count: int, store: str | None) -> Iterator[list[str]]:
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    try:
        for n in range(count):
            data = tmp / f"node{n}"
            data.mkdir(exist_ok=True)  # the replay's history is seeded in it already
            cfg = data / "bench.toml"
            text = "[server]\nmax_queued_tasks = 1000000\n"
            if store:
                text += f'[store]\nurl = "{store}"\n[cluster]\nnode_id = "bench-{n}"\n'
            cfg.write_text(text)
            port = free_port()
            env = {**os.environ, "LMSPD_DATA_DIR": str(data), "LMSPD_WEIGHT_DTYPE": "quantized"}
            cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--port", str(port), "--config", str(cfg)]
            procs.append(subprocess.Popen(cmd, env=env, stderr=(data / "log").open("wb")))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise SystemExit(f"a node exited: {(tmp / 'node0' / 'log').read_text()[-2000:]}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/readyz").status_code == 200:
                        break
                time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


async def intake(urls: list[str], clients: int, total: int) -> tuple[float, float, float, list[str]]:
    latencies: list[float] = []
    ids: list[str] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one_client(url: str, n: int) -> None:
            for _ in range(n):
                t = time.perf_counter()
                r = await client.post(f"{url}/lmsp/v1/tasks", json=BODY)
                latencies.append(time.perf_counter() - t)
                assert r.status_code == 202, r.text
                ids.append(r.json()["id"])

        start = time.perf_counter()
        await asyncio.gather(*(one_client(urls[i % len(urls)], total // clients) for i in range(clients)))
        elapsed = time.perf_counter() - start
    q = statistics.quantiles(latencies, n=100)
    return len(latencies) / elapsed, q[49] * 1e3, q[98] * 1e3, ids


def main(args: argparse.Namespace) -> None:
    rows: list[tuple[str, float, float, float]] = []
    replays: list[tuple[str, int, float]] = []
    given = None if args.store == "auto" else args.store
    missing = "no PostgreSQL here: pass --store postgresql://…, or apt install postgresql"
    with durable_cluster(given, missing) as server:
        base = server.url() if server else args.store
        for label, count, pg in [
            ("SQLite", 1, False),
            ("PostgreSQL", 1, True),
            ("PostgreSQL", 2, True),
            ("PostgreSQL", 3, True),
        ]:
            url = None
            if pg:
                url = server.create_database() if server else base
            with tempfile.TemporaryDirectory() as tmp, nodes(Path(tmp), count, url) as urls:
                rows.append(measure(label, count, urls, args))
        replays = replay_rows(server.create_database() if server else base, args.history)
    print(f"intake, {args.clients} clients over the nodes, {args.tasks} one-token tasks")
    print(f"{'store':<22} {'tasks/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name, rate, p50, p99 in rows:
        print(f"{name:<22} {rate:>9.0f} {p50:>8.1f} {p99:>8.1f}")
    print(f"replay of a finished task over SSE, Last-Event-ID: 0; median of {REPLAYS}, interleaved")
    print(f"{'store':<22} {'events':>9} {'events/s':>9}")
    for name, events, rate in replays:
        print(f"{name:<22} {events:>9} {rate:>9.0f}")


REPLAYS = 7


def replay_rows(pg_url: str, history: int) -> list[tuple[str, int, float]]:
    """One node on SQLite and one on PostgreSQL, up at once, each with a finished task of
    ``history`` events; their replays alternate, so a neighbour's load falls on both alike."""
    with tempfile.TemporaryDirectory() as lite, tempfile.TemporaryDirectory() as pg:
        (Path(lite) / "node0").mkdir()
        (Path(pg) / "node0").mkdir()
        seeded = [
            asyncio.run(seed_history(Path(lite) / "node0" / "lmspd.db", history)),
            asyncio.run(seed_history(Path(pg) / "node0" / "unused.db", history, pg_url)),
        ]
        with nodes(Path(lite), 1, None) as on_lite, nodes(Path(pg), 1, pg_url) as on_pg:
            urls = [on_lite[0], on_pg[0]]
            runs: list[list[tuple[int, float]]] = [[], []]
            for _ in range(REPLAYS):
                for i in (0, 1):
                    runs[i].append(asyncio.run(replay(urls[i], seeded[i], last_event_id=0)))
    return [
        (label, found[0][0], statistics.median(n / secs for n, secs in found))
        for label, found in zip(("SQLite", "PostgreSQL"), runs, strict=True)
    ]


def measure(label: str, count: int, urls: list[str], args: argparse.Namespace) -> tuple[str, float, float, float]:
    asyncio.run(intake(urls, args.clients, args.clients * 4))  # warm-up
    rate, p50, p99, _ = asyncio.run(intake(urls, args.clients, args.tasks))
    return f"{label}, {count} node{'s' if count > 1 else ''}", rate, p50, p99
