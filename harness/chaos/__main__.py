"""Chaos: ``lmspd serve`` killed with SIGKILL again and again under load, then checked.

    python -m harness.chaos [--cycles 20] [--engine-kills 2] [--seed 0] [--model NAME]
    python -m harness.chaos --nodes 3 [--store postgresql://…|temp] [--cycles 6]

With ``--nodes N`` the run is N nodes on one PostgreSQL, one of them killed each cycle while
the load runs on the others (:mod:`harness.chaos.nodes`); without, one server on SQLite:

Each cycle starts the server on the same data directory, runs a mixed load against it
(:mod:`harness.chaos.load`) and kills the whole process group (server and engine) with SIGKILL
at a random moment. Some kills come during startup (``--early-kills``), some during a clean
SIGTERM shutdown that has begun (``--term-kills``). ``--engine-kills`` more times, only the
engine process is killed mid-generation while the server lives on. After the last cycle a
clean run resumes every reader to its final event and drains every task, runs uninterrupted
references of the resumed tasks' inputs, and stops with SIGTERM; then the invariants
(:mod:`harness.chaos.checks`) are checked on the database and on what the clients were told.
Prints a table; exits 1 if any invariant was violated or the clean stop did not exit 0.

Kill moments and the load's choices come from ``--seed``; the timing of a real process does
not repeat exactly, so a failing seed reproduces the conditions, not the exact interleaving.
Default model: the test suite's tiny random-weight model (a cycle takes seconds); with a
real ``--model``, raise ``--max-kill-delay`` so that kills find it generating.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from . import nodes as nodes_db
from .checks import INVARIANTS, NODES_ONLY, SQLITE_ONLY, Report, check, read_db, resumed_mid_generation, snapshot_of
from .ledger import Ledger, Snapshot
from .load import Load, drain
from .nodes import Spread
from .server import Server, write_config


async def kill_engine(server: Server, ledger: Ledger) -> None:
    """SIGKILL the engine once a task is generating, then wait until the server has a new one."""
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(server.count, ("running",)) == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    old = server.engine_pid()
    if old is None:
        return
    running = await asyncio.to_thread(server.count, ("running",))
    os.kill(old, signal.SIGKILL)
    ledger.engine_kills += 1
    ledger.running_at_engine_kills += running
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        while time.monotonic() < deadline + 120:
            await asyncio.sleep(0.1)
            pid = server.engine_pid()
            if pid not in (None, old) and (await client.get("/readyz")).status_code == 200:
                return
    raise RuntimeError("the engine was not restarted within 3 minutes")


def snapshot(server: Server, ledger: Ledger, cycle: int) -> None:
    tasks, violations = snapshot_of(read_db(server.db))
    ledger.snapshots.append(Snapshot(cycle, tasks, violations))


async def cycles(args: argparse.Namespace, server: Server, ledger: Ledger, load: Load) -> None:
    rng = random.Random(args.seed)
    # The plan first: which kills come during startup (never the first: nothing to recover
    # yet), and in which of the other cycles the engine is killed.
    early = {c for c in range(1, args.cycles) if rng.random() < args.early_kills}
    served = [c for c in range(args.cycles) if c not in early]
    engine_at = [rng.choice(served) for _ in range(args.engine_kills)]
    startup = 5.0  # seconds the last start took: early kills spread over a whole startup
    for cycle in range(args.cycles):
        ledger.cycles += 1
        began = time.monotonic()
        server.spawn()
        if cycle in early:
            await asyncio.sleep(rng.uniform(0.2, 1.0) * startup)  # imports, recovery, engine, preload
            server.kill9()
            ledger.early_kills += 1
            snapshot(server, ledger, cycle)
            say(f"cycle {cycle + 1}/{args.cycles}: killed during startup after {time.monotonic() - began:.1f}s")
            continue
        await asyncio.to_thread(server.ready)
        ready = time.monotonic()
        startup = ready - began
        life = asyncio.create_task(load.life(server.url, submit=True))
        for _ in range(engine_at.count(cycle)):
            await asyncio.sleep(rng.uniform(0.5, 2.0))
            await kill_engine(server, ledger)
        await asyncio.sleep(rng.uniform(0.2, args.max_kill_delay))
        if rng.random() < args.term_kills:  # SIGKILL during a clean shutdown, as systemd does when it is slow
            load.stopping = True
            server.terminate()
            ledger.term_kills += 1
            await asyncio.sleep(rng.uniform(0.0, 1.0))
        server.kill9()
        life.cancel()
        await asyncio.gather(life, return_exceptions=True)
        if not life.cancelled() and life.exception():  # the harness itself broke
            raise RuntimeError("the load failed") from life.exception()
        snapshot(server, ledger, cycle)
        say(
            f"cycle {cycle + 1}/{args.cycles}: ready in {ready - began:.1f}s, killed {time.monotonic() - ready:.1f}s "
            f"later; {len(ledger.acks)} acknowledged so far"
        )


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def final_run(args: argparse.Namespace, server: Server, load: Load) -> int:
    """A clean life: every reader resumes to its end, every task drains; SIGTERM's exit code."""
    began = time.monotonic()
    server.spawn()
    await asyncio.to_thread(server.ready)
    say(f"final run: ready in {time.monotonic() - began:.1f}s, {server.count()} tasks to drain")
    try:
        await asyncio.wait_for(load.life(server.url, submit=False), args.drain_timeout)
    except TimeoutError:
        load.ledger.errors.append(f"the readers did not all reach a final event within {args.drain_timeout}s")
    await drain(server, args.drain_timeout)
    resumed = resumed_mid_generation(read_db(server.db, integrity=False))
    await load.references(server.url, sorted(set(resumed.values())))
    await drain(server, args.drain_timeout)
    await load.verify(server.url)
    say(f"final run: drained in {time.monotonic() - began:.1f}s")
    return server.stop()


def table(args: argparse.Namespace, ledger: Ledger, report: Report, seconds: float, stop_code: int) -> str:
    acks = list(ledger.acks.values())
    tasks = [a for a in acks if a.kind == "task"]
    policies = ", ".join(f"{sum(a.policy == p for a in tasks)} {p}" for p in ("fail", "retry", "resume"))
    kinds = {k: sum(a.kind == k for a in acks) for k in ("background", "stream")}
    restarts = ", ".join(f"{n} {reason}" for reason, n in sorted(report.restarts.items())) or "none"
    received = sum(len(r.events) for r in ledger.received.values())
    if args.nodes:
        head = [
            f"chaos: {args.nodes} nodes on one PostgreSQL, seed {args.seed}, "
            f"model {args.model or 'tiny (random weights)'}, {seconds:.0f} s",
            f"  kills       {ledger.node_kills} SIGKILL of a node (server + engine) under load, "
            f"{ledger.running_at_node_kills} tasks running on it; {ledger.node_kills_taken_over} back only "
            f"after a survivor took its tasks over, the others at once",
            f"  holders     {ledger.holder_samples} samples of who holds each started task, "
            f"{ledger.holder_changes} changes of node",
        ]
    else:
        head = [
            f"chaos: seed {args.seed}, model {args.model or 'tiny (random weights)'}, {seconds:.0f} s",
            f"  kills       {ledger.cycles} SIGKILL of server + engine ({ledger.early_kills} during startup, "
            f"{ledger.term_kills} during a SIGTERM shutdown); {ledger.engine_kills} of the engine alone "
            f"({ledger.running_at_engine_kills} tasks running)",
        ]
    lines = [
        *head,
        f"  tasks       {len(tasks)} acknowledged ({policies}); "
        f"{report.interrupted_by_kill} tasks/responses were loading/running at a kill",
        f"  responses   {kinds['background']} background, {kinds['stream']} streamed (/v1)",
        f"  events      {report.events} in the logs; {received} received by clients "
        f"over {len(ledger.connections)} SSE connections",
        f"  SSE resumes {ledger.sse_resumes} (Last-Event-ID, after, starting_after)",
        f"  retries     {ledger.replays} idempotent replays; restarts: {restarts}; {ledger.cancels} cancels",
        f"  lost        {report.lost}",
        f"  clean stop  exit {stop_code}",
        f"  machine     {os.cpu_count()} CPUs, load average {os.getloadavg()[1]:.1f} over the last 5 minutes",
        "",
        f"  {'invariant':<48} {'checked':>9} {'violations':>11}",
    ]
    for key, title in INVARIANTS.items():
        if key in (SQLITE_ONLY if args.nodes else NODES_ONLY):
            continue
        lines.append(f"  {title:<48} {report.checked.get(key, 0):>9} {len(report.violations[key]):>11}")
    for key, found in report.violations.items():
        for item in found[:10]:
            lines.append(f"  ! {key}: {item}")
        if len(found) > 10:
            lines.append(f"  ! {key}: ... {len(found) - 10} more")
    return "\n".join(lines)


async def main_nodes(args: argparse.Namespace) -> int:
    """--nodes N: several nodes on one PostgreSQL (harness.chaos.nodes)."""
    start = time.monotonic()
    data = Path(tempfile.mkdtemp(prefix="lmspd-chaos-"))
    ledger = Ledger()
    with nodes_db.database(args.store) as url:
        cluster = nodes_db.Nodes(data, args.model, url, args.nodes)
        say(f"chaos: data directory {data}, {args.nodes} nodes, model ready in {time.monotonic() - start:.1f}s")
        spread = random.Random(args.seed + 2)
        load = Load(ledger, random.Random(args.seed + 1), cluster, args.max_active, lambda: Spread(cluster, spread))
        began = time.monotonic()
        await asyncio.to_thread(cluster.start_all)  # the first one up has made the schema
        say(f"{args.nodes} nodes ready in {time.monotonic() - began:.1f}s")
        holders = nodes_db.Holders(url, ledger)
        holders.start()
        try:
            await nodes_db.node_cycles(args, cluster, ledger, load, say)
            stop_code = await nodes_db.node_final_run(args, cluster, load, say)
        finally:
            holders.stop()
            cluster.kill_all()
        report = check(cluster.read(), ledger)
    return verdict(args, ledger, report, time.monotonic() - start, stop_code, data, "node logs")


def verdict(
    args: argparse.Namespace, ledger: Ledger, report: Report, secs: float, stop_code: int, data: Path, logs: str
) -> int:
    """The run's table printed; its data removed if it passed (unless --keep); its exit code."""
    print(table(args, ledger, report, secs, stop_code))
    if report.ok and stop_code == 0 and not args.keep:
        shutil.rmtree(data, ignore_errors=True)
    else:
        print(f"data directory and {logs} kept: {data} (reproduce: --seed {args.seed})")
    return 0 if report.ok and stop_code == 0 else 1


async def main(args: argparse.Namespace) -> int:
    if args.nodes:
        return await main_nodes(args)
    start = time.monotonic()
    data = Path(tempfile.mkdtemp(prefix="lmspd-chaos-"))
    server = Server(write_config(data, args.model), data)
    say(f"chaos: data directory {data}, model ready in {time.monotonic() - start:.1f}s")
    ledger = Ledger()
    load = Load(ledger, random.Random(args.seed + 1), server, args.max_active)
    try:
        await cycles(args, server, ledger, load)
        stop_code = await final_run(args, server, load)
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.kill9()
    report = check(read_db(server.db), ledger)
    return verdict(args, ledger, report, time.monotonic() - start, stop_code, data, "server log")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m harness.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=20, help="server kill -9 cycles")
    parser.add_argument("--engine-kills", type=int, default=2, help="engine-only kills mid-generation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a model name (default: a tiny random-weight model)")
    parser.add_argument("--max-kill-delay", type=float, default=6.0, help="seconds after ready, at most")
    parser.add_argument("--early-kills", type=float, default=0.1, help="share of kills during startup")
    parser.add_argument("--term-kills", type=float, default=0.15, help="share of kills during a SIGTERM shutdown")
    parser.add_argument("--max-active", type=int, default=16, help="unfinished tasks before submitters wait")
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    parser.add_argument("--nodes", type=int, default=0, help="N nodes on one PostgreSQL (0: one server on SQLite)")
    parser.add_argument("--store", default=None, help="with --nodes: a postgresql:// URL, or temp (default)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
