"""The task store on both databases: a real SQLite file and a real PostgreSQL (the ``store_url``
fixture, tests/conftest.py): schema, state machine, idempotency, event log, retention."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from lmspd.errors import (
    IdempotencyKeyReusedError,
    QueueFullError,
    TaskNotCancelableError,
    TaskNotFoundError,
)
from lmspd.store.conn import Conn
from lmspd.store.migrate import MigrationError, migrate, migrations_dir
from lmspd.store.opening import open_database
from lmspd.store.pg_migrate import latest_version
from lmspd.store.status import TERMINAL, TRANSITIONS
from lmspd.store.task_store import NewEvent, TaskRecord, TaskStore
from lmspd.store.url import StoreUrl

EXPECTED_SCHEMA = {
    "tasks": [
        "id",
        "owner",
        "type",
        "status",
        "on_restart",
        "request",
        "response_id",
        "response",
        "error",
        "attempt",
        "next_seq",
        "events_expired",
        "created_at",
        "updated_at",
        "finished_at",
        "kind",
        "background",
        "stored",
        "previous_response_id",
        "expires_at",
        "conversation",
    ],
    "events": ["task_id", "seq", "type", "data", "tokens"],
    "idempotency_keys": ["owner", "key", "fingerprint", "task_id", "created_at"],
    "task_counts": ["status", "n"],
    "reasoning_echo": ["owner", "key", "item", "size", "used_at"],
    "reasoning_echo_bytes": ["id", "total"],
    "response_items": ["owner", "item_id", "task_id"],
}
EXPECTED_TRIGGERS = {
    "task_counts_insert",
    "task_counts_update",
    "task_counts_delete",
    "reasoning_echo_insert",
    "reasoning_echo_update",
    "reasoning_echo_delete",
}
EXPECTED_INDEXES = {
    "tasks_by_status",
    "tasks_by_owner",
    "tasks_by_finished",
    "tasks_by_expiry",
    "tasks_by_conversation",
    "reasoning_echo_by_use",
    "response_items_by_task",
}


def event(etype: str):  # type: ignore[no-untyped-def]
    def build(task: TaskRecord, seq: int) -> NewEvent:
        return NewEvent(etype, msgspec.json.encode({"type": etype, "sequence_number": seq, "task": task.id}))

    return build


# SQLite's counters kept by triggers; PostgreSQL counts from its indexes (migrations/postgresql).
SQLITE_ONLY = {"task_counts", "reasoning_echo_bytes"}
# PostgreSQL's own: the nodes' leases (migrations/postgresql/002_nodes.sql).
NODES = ["id", "epoch", "host", "pid", "url", "models", "running", "started_at", "heartbeat_at", "expires_at"]


@pytest.fixture
async def store(store_url: StoreUrl) -> AsyncIterator[TaskStore]:
    db = await open_database(store_url)
    yield TaskStore(db, max_queued=50)
    await db.close()


async def create(store: TaskStore, key: str | None = None, body: bytes = b"{}") -> tuple[TaskRecord, bool]:
    return await store.create(
        owner="alice",
        request=body,
        on_restart="fail",
        first_event=event("response.created"),
        idempotency=(key, body.hex()) if key else None,
    )


def test_no_migrations_is_an_error_not_an_empty_database(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "empty.db", isolation_level=None)
    (tmp_path / "migrations").mkdir()
    with pytest.raises(MigrationError, match="no migrations found"):
        migrate(conn, tmp_path / "migrations")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 0


def test_migrations_produce_exactly_the_schema(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "schema.db", isolation_level=None)
    assert migrate(conn) == len([f for f in migrations_dir().iterdir() if f.name.endswith(".sql")])
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert tables == set(EXPECTED_SCHEMA)
    for table, columns in EXPECTED_SCHEMA.items():
        assert [r[1] for r in conn.execute(f"PRAGMA table_info({table})")] == columns
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}
    assert indexes == EXPECTED_INDEXES
    triggers = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
    assert triggers == EXPECTED_TRIGGERS
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 6
    assert migrate(conn) == 6  # idempotent


async def test_pg_migration_makes_the_same_tables_and_columns(store_url: StoreUrl) -> None:
    if store_url.dialect != "postgresql":
        return  # SQLite's schema: test_migrations_produce_exactly_the_schema
    db = await open_database(store_url)
    try:
        rows = await db.fetchall(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public'"
            " ORDER BY table_name, ordinal_position"
        )
        found: dict[str, list[str]] = {}
        for table, column in rows:
            found.setdefault(table, []).append(column)
        assert found.pop("lmspd_schema") == ["version"]
        assert found.pop("nodes") == NODES
        assert found.pop("secrets") == ["name", "value"]  # the nodes' shared reasoning key
        # The claim's: who holds it (002), its model and prompt cache's node (004).
        claims = ["node", "epoch", "model", "cache_key", "affinity", "queued_at"]
        assert found.pop("tasks") == [*EXPECTED_SCHEMA["tasks"], *claims]
        assert found == {t: c for t, c in EXPECTED_SCHEMA.items() if t not in {*SQLITE_ONLY, "tasks"}}
        version = await db.fetchone("SELECT version FROM lmspd_schema")
        assert version is not None and version[0] == latest_version() == 4
    finally:
        await db.close()
    again = await open_database(store_url)  # migrating again changes nothing
    assert [tuple(r) for r in await again.fetchall("SELECT version FROM lmspd_schema")] == [(4,)]
    await again.close()


async def test_commits_wait_for_the_disk(store: TaskStore) -> None:
    if store.db.dialect == "sqlite":
        assert (await store.db.fetchone("PRAGMA journal_mode"))[0] == "wal"  # type: ignore[index]
    else:  # the writer's session: every COMMIT waits for its WAL flush
        assert await store.db.writer.submit(lambda conn: conn.execute("SHOW synchronous_commit").fetchone()[0]) == "on"


async def test_create_persists_task_and_first_event(store: TaskStore, store_url: StoreUrl) -> None:
    task, replayed = await create(store)
    assert not replayed and task.status == "queued" and task.next_seq == 1
    assert task.id.startswith("task_") and task.response_id.startswith("resp_")
    # Visible to separate connections: committed, not just buffered.
    other = await open_database(store_url)
    try:
        found = await other.fetchone(other.q("get_task"), {"id": task.id})
        assert found is not None and found["status"] == "queued"
        events = await other.fetchall(other.q("events_after"), {"task_id": task.id, "after": -1, "limit": 10})
        assert [(e["seq"], e["type"]) for e in events] == [(0, "response.created")]
    finally:
        await other.close()


async def test_state_machine_first_committed_transition_wins(store: TaskStore) -> None:
    task, _ = await create(store)
    assert (await store.transition(task.id, "loading")) is not None
    assert (await store.transition(task.id, "running")) is not None
    # succeeded and cancelling exclude each other: whichever commits first wins.
    results = await asyncio.gather(store.transition(task.id, "succeeded"), store.transition(task.id, "cancelling"))
    assert [r is not None for r in results] == [True, False]
    assert (await store.get(task.id)).status == "succeeded"


async def test_a_transition_via_a_status_takes_both_steps_or_neither(store: TaskStore) -> None:
    task, _ = await create(store)
    moved = await store.transition(task.id, "running", via="loading")
    assert moved is not None and moved.status == "running"
    # From running, "loading" is not allowed: neither step happens.
    other, _ = await create(store)
    assert await store.transition(other.id, "loading") is not None
    assert await store.transition(other.id, "running", via="loading") is None
    assert (await store.get(other.id)).status == "loading"
    # The first step fails (a cancelled task): nothing changes either.
    gone, _ = await create(store)
    assert await store.transition(gone.id, "cancelled") is not None
    assert await store.transition(gone.id, "running", via="loading") is None
    assert (await store.get(gone.id)).status == "cancelled"


@pytest.mark.parametrize("terminal", sorted(TERMINAL))
async def test_terminal_states_never_change(store: TaskStore, terminal: str) -> None:
    task, _ = await create(store)
    path = {"succeeded": ["loading", "running", "succeeded"], "failed": ["failed"], "cancelled": ["cancelled"]}
    for status in path[terminal]:
        assert await store.transition(task.id, status) is not None  # type: ignore[arg-type]
    for status in ["queued", "loading", "running", "cancelling", *TERMINAL]:
        assert await store.transition(task.id, status) is None  # type: ignore[arg-type]
    final = await store.get(task.id)
    assert final.status == terminal and final.finished_at is not None


def test_transition_table_matches_lmsp_7_2() -> None:
    assert {
        "queued": {"loading", "cancelled", "failed"},
        "loading": {"running", "cancelling", "failed"},
        "running": {"succeeded", "failed", "cancelling"},
        "cancelling": {"cancelled"},
    } == TRANSITIONS


async def test_cancel_semantics(store: TaskStore) -> None:
    queued, _ = await create(store)
    done = await store.cancel(queued.id, "alice", final_events=[event("response.cancelled")])
    assert done.status == "cancelled"
    assert [e.type for e in await store.events_after(queued.id, -1)] == ["response.created", "response.cancelled"]
    assert (await store.cancel(queued.id, "alice", final_events=[event("x")])).status == "cancelled"  # idempotent

    running, _ = await create(store)
    await store.transition(running.id, "loading")
    await store.transition(running.id, "running")
    assert (await store.cancel(running.id, "alice", final_events=[event("x")])).status == "cancelling"
    assert (await store.cancel(running.id, "alice", final_events=[event("x")])).status == "cancelling"
    assert await store.transition(running.id, "succeeded") is None  # cancelling only goes to cancelled
    assert (await store.transition(running.id, "cancelled")) is not None

    finished, _ = await create(store)
    await store.transition(finished.id, "failed")
    with pytest.raises(TaskNotCancelableError):
        await store.cancel(finished.id, "alice", final_events=[event("x")])
    with pytest.raises(TaskNotFoundError):
        await store.cancel("task_nope", "alice", final_events=[event("x")])
    with pytest.raises(TaskNotFoundError):  # another token's task is invisible
        await store.cancel(running.id, "mallory", final_events=[event("x")])


async def test_cancel_racing_completion_100_times(store: TaskStore) -> None:
    for _ in range(100):
        task, _ = await create(store)
        await store.transition(task.id, "loading")
        await store.transition(task.id, "running")
        await asyncio.gather(
            store.cancel(task.id, "alice", final_events=[event("response.cancelled")]),
            store.transition(task.id, "succeeded", events=[event("response.completed")]),
            return_exceptions=True,
        )
        await store.transition(task.id, "cancelled", events=[event("response.cancelled")])
        final = await store.get(task.id)
        types = [e.type for e in await store.events_after(task.id, -1)]
        assert final.status in ("succeeded", "cancelled")
        assert types == [
            "response.created",
            "response.completed" if final.status == "succeeded" else "response.cancelled",
        ]


async def test_concurrent_duplicate_idempotency_keys_make_one_task(store: TaskStore) -> None:
    results = await asyncio.gather(*(create(store, key="k1", body=b'{"a":1}') for _ in range(20)))
    assert len({t.id for t, _ in results}) == 1
    assert sorted(r for _, r in results) == [False] + [True] * 19
    with pytest.raises(IdempotencyKeyReusedError):
        await create(store, key="k1", body=b'{"a":2}')
    assert len(await store.list("alice", limit=100)) == 1


async def test_events_are_gap_free(store: TaskStore) -> None:
    task, _ = await create(store)
    await asyncio.gather(*(store.append_events(task.id, [event(f"e{i}")]) for i in range(30)))
    events = await store.events_after(task.id, -1)
    assert [e.seq for e in events] == list(range(31))
    for after in range(-1, 31):
        assert [e.seq for e in await store.events_after(task.id, after)] == list(range(after + 1, 31))
    assert all(msgspec.json.decode(e.data)["sequence_number"] == e.seq for e in events)


async def test_queue_is_bounded(store: TaskStore) -> None:
    await asyncio.gather(*(create(store) for _ in range(50)))
    with pytest.raises(QueueFullError):
        await create(store)


async def test_list_is_newest_first_with_cursor(store: TaskStore) -> None:
    ids = [(await create(store))[0].id for _ in range(5)]
    page = await store.list("alice", limit=3)
    assert [t.id for t in page] == ids[::-1][:3]
    rest = await store.list("alice", limit=3, after=page[-1].id)
    assert [t.id for t in rest] == ids[::-1][3:]
    assert await store.list("mallory") == []


async def test_retention_purges_events_then_tasks(store: TaskStore) -> None:
    old, _ = await create(store, key="old-key")
    await store.append_events(old.id, [event("e")] * 3)
    await store.transition(old.id, "failed", events=[event("response.failed")])
    live, _ = await create(store)
    finished_at = (await store.get(old.id)).finished_at
    assert finished_at is not None

    # Inside both windows nothing goes.
    kept = await store.purge(
        event_retention_secs=100, task_retention_secs=1000, idempotency_retention_secs=1000, now=finished_at + 50
    )
    assert kept == type(kept)()
    # Past the event window: events go (the task says so), the task stays.
    counts = await store.purge(
        event_retention_secs=100,
        task_retention_secs=1000,
        idempotency_retention_secs=1000,
        now=finished_at + 101,
        batch=2,
    )
    assert (counts.tasks_with_expired_events, counts.events, counts.tasks) == (1, 5, 0)
    assert (await store.get(old.id)).events_expired == 1
    assert await store.events_after(old.id, -1) == []
    assert len(await store.events_after(live.id, -1)) == 1  # an unfinished task keeps its events
    # Past the task window: the task goes, an unfinished one never does.
    counts = await store.purge(
        event_retention_secs=100, task_retention_secs=1000, idempotency_retention_secs=10, now=finished_at + 1001
    )
    assert (counts.tasks, counts.idempotency_keys) == (1, 1)
    with pytest.raises(TaskNotFoundError):
        await store.get(old.id)
    assert (await store.get(live.id)).status == "queued"


async def test_status_counts_follow_every_change(store: TaskStore) -> None:
    ids = [(await create(store))[0].id for _ in range(4)]
    await store.transition(ids[0], "loading")
    await store.transition(ids[1], "cancelled")
    await store.cancel(ids[2], "alice", final_events=[event("response.cancelled")])
    await store.purge(event_retention_secs=0, task_retention_secs=-10, idempotency_retention_secs=0)
    counts = {status: n for status, n in (await store.status_counts()).items() if n > 0}
    actual = {status: n for status, n in await store.db.fetchall("SELECT status, count(*) FROM tasks GROUP BY status")}
    assert counts == actual == {"queued": 1, "loading": 1}


async def test_a_failing_job_fails_alone_in_its_group_commit(store: TaskStore) -> None:
    task, _ = await create(store)

    def orphan(conn: Conn) -> None:  # an event of no task: the foreign key refuses it
        conn.run("insert_event", {"task_id": "task_nope", "seq": 0, "type": "x", "data": b"{}", "tokens": None})

    jobs = [store.append_events(task.id, [event(f"e{i}")]) for i in range(5)]
    before = store.db.writer.commits
    results = await asyncio.gather(*jobs[:2], store.db.writer.submit(orphan), *jobs[2:], return_exceptions=True)
    assert [isinstance(r, Exception) for r in results] == [False, False, True, False, False, False]
    assert store.db.writer.commits - before < 6  # they shared commits
    assert [e.type for e in await store.events_after(task.id, -1)] == ["response.created"] + [f"e{i}" for i in range(5)]


async def test_intake_runs_first_in_its_group_commit(store: TaskStore) -> None:
    """A job submitted ``first`` (intake: its lock comes before any row lock on PostgreSQL) runs
    before the batch's others, which keep their order; each still gets its own result."""
    ran: list[str] = []

    def job(name: str):  # type: ignore[no-untyped-def]
        def run(conn: Conn) -> str:
            ran.append(name)
            return name

        return run

    writer = store.db.writer
    before = writer.commits
    names = ["a", "b", "intake-1", "c", "intake-2"]
    results = await asyncio.gather(*(writer.submit(job(n), first=n.startswith("intake")) for n in names))
    assert results == names
    assert writer.commits - before == 1  # one batch, so its order is the writer's doing
    assert ran == ["intake-1", "intake-2", "a", "b", "c"]
