"""A finished task with a long event history, written through the store before a server
starts: what replay is measured on (bench/tasks.py, bench/cluster_intake.py) and what the slow
readers are fed (harness/sse_abuse.py, tests/api/test_sse_slow_reader.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from lmspd.responses.builder import ResponseState, initial_response
from lmspd.responses.schema import ResponseRequest
from lmspd.store.opening import open_database
from lmspd.store.task_store import TaskStore
from lmspd.store.url import StoreUrl


async def seed_history(db_path: Path, n: int, url: str | None = None) -> str:
    """A finished task with ``n`` events, written through the store before the server starts
    (``url``: into that PostgreSQL database instead of the SQLite file)."""
    db = await open_database(StoreUrl.parse(url, db_path))
    store = TaskStore(db)
    request = ResponseRequest(input="history")

    def first(task, seq):  # type: ignore[no-untyped-def]
        resp = initial_response(request, response_id=task.response_id, model="bench", created_at=task.created_at)
        return ResponseState(resp).created()[0](task, seq)

    task, _ = await store.create(owner="", request=msgspec.json.encode(request), on_restart="fail", first_event=first)
    state = ResponseState.from_events(await store.events_after(task.id, -1))
    await store.transition(task.id, "loading")
    await store.transition(task.id, "running", events=state.in_progress())
    batch = 500
    for _ in range((n - 2) // batch):
        await store.append_events(task.id, [b for i in range(batch) for b in state.delta(f"w{i} ", [1])][:batch])
    remaining = n - 2 - ((n - 2) // batch) * batch - 5
    await store.append_events(task.id, [b for i in range(remaining) for b in state.delta("x", [1])][:remaining])
    await store.transition(task.id, "succeeded", events=state.finish("stop", 3))
    count = (await store.get(task.id)).next_seq
    await db.close()
    assert count >= n - 5, count
    return task.id
