"""Which PostgreSQL driver for the store: task intake with psycopg 3 and with asyncpg, side by side.

    python -m bench.pg_drivers [--url postgresql://…] [--clients 64] [--tasks 2000] [--rounds 3]

Without ``--url`` it starts a PostgreSQL of its own (harness/postgres.py: initdb and pg_ctl in a
temporary directory, fsync on as a server would run). Each row makes ``--tasks`` tasks from
``--clients`` concurrent callers, each task what ``TaskStore.create`` writes (the queue bound read,
the task row, its first event, the sequence number advanced, the task read back), all waiting callers
group-committed in one transaction, each in its own savepoint:

- ``psycopg sync, writer thread``: a synchronous psycopg connection on a thread of its own running
  plain synchronous jobs: what the store does (the same jobs run on SQLite);
- ``psycopg async``: the same transaction on psycopg's AsyncConnection;
- ``asyncpg``: the same on asyncpg (prepared statements, binary protocol);
- ``lmspd TaskStore (psycopg)``: the store itself, metrics and all; and SQLite's, for scale.

Prints tasks/s and p50/p99 of one create. docs/operations.md ("Choosing the driver") has a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
from ulid import monotonic as ulid

from harness.postgres import durable_cluster
from lmspd.store.opening import open_database
from lmspd.store.pg_migrate import migrate_pg
from lmspd.store.task_store import NewEvent, TaskRecord, TaskStore
from lmspd.store.url import StoreUrl

EVENT = b'{"type":"response.created","sequence_number":0}'
INSERT_TASK = (
    "INSERT INTO tasks (id, owner, status, on_restart, request, response_id, next_seq, created_at, updated_at)"
    " VALUES ({}, '', 'queued', 'fail', {}, {}, 0, {}, {})"
)
COUNT = "SELECT count(*) FROM tasks WHERE status = 'queued'"
EVENT_SQL = "INSERT INTO events (task_id, seq, type, data) VALUES ({}, 0, 'response.created', {})"
ADVANCE = "UPDATE tasks SET next_seq = 1 WHERE id = {} AND next_seq = 0"
GET = "SELECT * FROM tasks WHERE id = {}"


def psycopg_sql(template: str, n: int) -> str:
    return template.format(*["%s"] * n)


def asyncpg_sql(template: str, n: int) -> str:
    return template.format(*[f"${i + 1}" for i in range(n)])


class GroupCommit:
    """Callers' jobs gathered and run in one transaction by ``run_batch`` (each job's result back)."""

    def __init__(self, run_batch: Callable[[list[Any]], Awaitable[list[Any]]]) -> None:
        self.run_batch = run_batch
        self.pending: list[tuple[Any, asyncio.Future[Any]]] = []
        self.wake = asyncio.Event()
        self.task = asyncio.create_task(self.loop())

    async def submit(self, job: Any) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append((job, fut))
        self.wake.set()
        return await fut

    async def loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.pending = self.pending[:512], self.pending[512:]
            if self.pending:
                self.wake.set()
            if batch:
                for (_, fut), value in zip(batch, await self.run_batch([j for j, _ in batch]), strict=True):
                    fut.set_result(value)


def ids() -> tuple[str, str]:
    return f"task_{ulid.new()}", f"resp_{ulid.new()}"


async def psycopg_thread(url: str) -> AsyncIterator[Callable[[], Awaitable[Any]]]:
    conn = psycopg.connect(url, autocommit=True)
    pool = ThreadPoolExecutor(1)
    sqls = [psycopg_sql(INSERT_TASK, 5), psycopg_sql(EVENT_SQL, 2), psycopg_sql(ADVANCE, 1), psycopg_sql(GET, 1)]

    def job(c: psycopg.Connection[Any], task_id: str, resp: str) -> Any:
        c.execute(COUNT).fetchone()
        now = int(time.time())
        c.execute(sqls[0], (task_id, b"{}", resp, now, now))
        c.execute(sqls[1], (task_id, EVENT))
        c.execute(sqls[2], (task_id,))
        return c.execute(sqls[3], (task_id,)).fetchone()

    def batch(jobs: list[tuple[str, str]]) -> list[Any]:
        out = []
        conn.execute("BEGIN")
        for task_id, resp in jobs:
            conn.execute("SAVEPOINT job")
            out.append(job(conn, task_id, resp))
            conn.execute("RELEASE job")
        conn.execute("COMMIT")
        return out

    gc = GroupCommit(lambda jobs: asyncio.get_running_loop().run_in_executor(pool, batch, jobs))
    yield lambda: gc.submit(ids())
    gc.task.cancel()
    conn.close()
    pool.shutdown()


async def psycopg_async(url: str) -> AsyncIterator[Callable[[], Awaitable[Any]]]:
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    sqls = [psycopg_sql(INSERT_TASK, 5), psycopg_sql(EVENT_SQL, 2), psycopg_sql(ADVANCE, 1), psycopg_sql(GET, 1)]

    async def batch(jobs: list[tuple[str, str]]) -> list[Any]:
        out = []
        await conn.execute("BEGIN")
        for task_id, resp in jobs:
            await conn.execute("SAVEPOINT job")
            await (await conn.execute(COUNT)).fetchone()
            now = int(time.time())
            await conn.execute(sqls[0], (task_id, b"{}", resp, now, now))
            await conn.execute(sqls[1], (task_id, EVENT))
            await conn.execute(sqls[2], (task_id,))
            out.append(await (await conn.execute(sqls[3], (task_id,))).fetchone())
            await conn.execute("RELEASE job")
        await conn.execute("COMMIT")
        return out

    gc = GroupCommit(batch)
    yield lambda: gc.submit(ids())
    gc.task.cancel()
    await conn.close()


async def asyncpg_driver(url: str) -> AsyncIterator[Callable[[], Awaitable[Any]]]:
    conn = await asyncpg.connect(url)
    sqls = [asyncpg_sql(INSERT_TASK, 5), asyncpg_sql(EVENT_SQL, 2), asyncpg_sql(ADVANCE, 1), asyncpg_sql(GET, 1)]

    async def batch(jobs: list[tuple[str, str]]) -> list[Any]:
        out = []
        async with conn.transaction():
            for task_id, resp in jobs:
                async with conn.transaction():  # a savepoint
                    await conn.fetchval(COUNT)
                    now = int(time.time())
                    await conn.execute(sqls[0], task_id, b"{}", resp, now, now)
                    await conn.execute(sqls[1], task_id, EVENT)
                    await conn.execute(sqls[2], task_id)
                    out.append(await conn.fetchrow(sqls[3], task_id))
        return out

    gc = GroupCommit(batch)
    yield lambda: gc.submit(ids())
    gc.task.cancel()
    await conn.close()


def first(task: TaskRecord, seq: int) -> NewEvent:
    return NewEvent("response.created", EVENT)


async def task_store_at(url: StoreUrl) -> AsyncIterator[Callable[[], Awaitable[Any]]]:
    db = await open_database(url)
    store = TaskStore(db, max_queued=10**9)
    yield lambda: store.create(owner="", request=b"{}", on_restart="fail", first_event=first)
    await db.close()


async def measure(make: AsyncIterator[Callable[[], Awaitable[Any]]], clients: int, total: int) -> tuple[float, ...]:
    create = await anext(make)
    latencies: list[float] = []

    async def caller(n: int) -> None:
        for _ in range(n):
            t = time.perf_counter()
            await create()
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(caller(5) for _ in range(clients)))  # warm: connections, prepared statements
    latencies.clear()
    start = time.perf_counter()
    await asyncio.gather(*(caller(total // clients) for _ in range(clients)))
    elapsed = time.perf_counter() - start
    with contextlib.suppress(StopAsyncIteration):
        await anext(make)
    q = statistics.quantiles(latencies, n=100)
    return len(latencies) / elapsed, q[49] * 1e3, q[98] * 1e3


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a PostgreSQL to use (default: one started here)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with durable_cluster(args.url, "no PostgreSQL here: pass --url, or apt install postgresql") as server:
        base = args.url or (server.url() if server else "")
        drivers: list[tuple[str, Callable[[str], AsyncIterator[Callable[[], Awaitable[Any]]]]]] = [
            ("psycopg sync, writer thread", psycopg_thread),
            ("psycopg async", psycopg_async),
            ("asyncpg", asyncpg_driver),
            ("lmspd TaskStore (psycopg)", lambda url: task_store_at(StoreUrl.parse(url, Path("unused")))),
        ]
        results: dict[str, list[tuple[float, ...]]] = {name: [] for name, _ in drivers}
        results["lmspd TaskStore (SQLite)"] = []
        # Rounds interleave the drivers, so a neighbour's load on the machine falls on all of them.
        for _ in range(args.rounds):
            for name, driver in drivers:
                url = server.create_database() if server else base
                with psycopg.connect(url, autocommit=True) as conn:
                    migrate_pg(conn)
                results[name].append(await measure(driver(url), args.clients, args.tasks))
                if server:
                    server.drop_database(url)
            with tempfile.TemporaryDirectory() as tmp:
                lite = StoreUrl("sqlite", "", Path(tmp) / "bench.db")
                results["lmspd TaskStore (SQLite)"].append(await measure(task_store_at(lite), args.clients, args.tasks))
    print(f"task intake, {args.clients} concurrent callers, {args.tasks} tasks, group commit; median of {args.rounds}")
    print(f"{'driver':<30} {'tasks/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name, runs in results.items():
        rate, p50, p99 = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"{name:<30} {rate:>9.0f} {p50:>8.1f} {p99:>8.1f}")


if __name__ == "__main__":
    asyncio.run(main())
