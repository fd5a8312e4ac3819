"""What the intake lock costs: task intake on PostgreSQL from 1, 2 and 3 nodes, with the lock that
makes the queue bound hold across nodes (as shipped) and without it, side by side.

    python -m bench.intake_lock [--url postgresql://…] [--clients 48] [--tasks 3000] [--rounds 3]

Each "node" is a database connection of its own with its own group-committing writer (what a
``lmspd serve`` node's store is); ``--clients`` concurrent callers are spread over the nodes,
each making tasks with ``TaskStore.create`` (the bound read, the task, its first event). Without
the lock (``intake_lock`` made a no-op in this process only) the nodes' batches commit in
parallel and the bound can be overshot by about a batch per node; with it, they take turns
(docs/operations.md, "Several nodes"). Without ``--url`` a PostgreSQL of its own is started
(harness/postgres.py), fsync on. Rounds interleave the rows; the median of each is shown.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import psycopg

from harness.postgres import durable_cluster
from lmspd.store.opening import open_database
from lmspd.store.pg_migrate import migrate_pg
from lmspd.store.queries import queries
from lmspd.store.task_store import NewEvent, TaskRecord, TaskStore
from lmspd.store.url import StoreUrl

EVENT = b'{"type":"response.created","sequence_number":0}'
SHIPPED = queries("postgresql")["intake_lock"]


def first(task: TaskRecord, seq: int) -> NewEvent:
    return NewEvent("response.created", EVENT)


async def measure(url: str, nodes: int, clients: int, total: int) -> tuple[float, float, float]:
    dbs = [await open_database(StoreUrl.parse(url, Path("unused"))) for _ in range(nodes)]
    stores = [TaskStore(db, max_queued=10**9) for db in dbs]
    latencies: list[float] = []

    async def caller(store: TaskStore, n: int) -> None:
        for _ in range(n):
            t = time.perf_counter()
            await store.create(owner="", request=b"{}", on_restart="fail", first_event=first)
            latencies.append(time.perf_counter() - t)

    try:
        await asyncio.gather(*(caller(stores[i % nodes], 5) for i in range(clients)))  # warm
        latencies.clear()
        start = time.perf_counter()
        await asyncio.gather(*(caller(stores[i % nodes], total // clients) for i in range(clients)))
        elapsed = time.perf_counter() - start
    finally:
        for db in dbs:
            await db.close()
    q = statistics.quantiles(latencies, n=100)
    return len(latencies) / elapsed, q[49] * 1e3, q[98] * 1e3


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a PostgreSQL to use (default: one started here)")
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--tasks", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rows = [
        (f"{n} node{'s' if n > 1 else ''}, {'with' if lock else 'without'} the lock", n, lock)
        for n in (1, 2, 3)
        for lock in (True, False)
    ]
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _, _ in rows}
    with durable_cluster(args.url, "no PostgreSQL here: pass --url, or apt install postgresql") as server:
        try:
            for _ in range(args.rounds):
                for name, n, lock in rows:
                    url = server.create_database() if server else args.url
                    with psycopg.connect(url, autocommit=True) as conn:
                        migrate_pg(conn)
                    queries("postgresql")["intake_lock"] = SHIPPED if lock else "SELECT 1"
                    results[name].append(await measure(url, n, args.clients, args.tasks))
                    if server:
                        server.drop_database(url)
        finally:
            queries("postgresql")["intake_lock"] = SHIPPED
    print(f"intake on PostgreSQL, {args.clients} callers over the nodes, {args.tasks} tasks; median of {args.rounds}")
    print(f"{'nodes':<30} {'tasks/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name, runs in results.items():
        rate, p50, p99 = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"{name:<30} {rate:>9.0f} {p50:>8.1f} {p99:>8.1f}")


if __name__ == "__main__":
    asyncio.run(main())
