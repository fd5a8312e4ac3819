"""Task store intake: concurrent clients create tasks on a real SQLite file (group commit).

    python -m bench.store [--clients 32] [--tasks 4000]

Measures the store layer alone (no HTTP): tasks committed per second with
synchronous=FULL, p50/p99 latency per create, and how many transactions (fsyncs)
the writer needed, against one transaction per task when clients run one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from lmspd.store.db import Database
from lmspd.store.task_store import NewEvent, TaskRecord, TaskStore


def created(task: TaskRecord, seq: int) -> NewEvent:
    return NewEvent("response.created", msgspec.json.encode({"type": "response.created", "sequence_number": seq}))


async def run(clients: int, total: int) -> tuple[float, list[float], int]:
    with tempfile.TemporaryDirectory() as tmp:
        db = await Database.open(Path(tmp) / "bench.db")
        store = TaskStore(db, max_queued=total + 1)
        latencies: list[float] = []

        async def client(n: int) -> None:
            for _ in range(n):
                t = time.perf_counter()
                await store.create(
                    owner="bench", request=b'{"model":"m","input":"hi"}', on_restart="fail", first_event=created
                )
                latencies.append(time.perf_counter() - t)

        start = time.perf_counter()
        await asyncio.gather(*(client(total // clients) for _ in range(clients)))
        elapsed = time.perf_counter() - start
        commits = db.writer.commits
        await db.close()
        return len(latencies) / elapsed, latencies, commits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tasks", type=int, default=4000)
    args = parser.parse_args()
    for clients, total in ((1, args.tasks // 8), (args.clients, args.tasks)):
        rate, lat, commits = asyncio.run(run(clients, total))
        q = statistics.quantiles(lat, n=100)
        print(
            f"{clients:>3} clients: {rate:8.0f} tasks/s  p50 {q[49] * 1e3:6.2f} ms  p99 {q[98] * 1e3:6.2f} ms  "
            f"{len(lat)} tasks in {commits} commits"
        )


if __name__ == "__main__":
    main()
