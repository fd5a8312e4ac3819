"""The task store: tasks, their event logs and idempotency keys, in SQLite or PostgreSQL.

Status changes are compare-and-set updates (``WHERE id = ? AND status IN (...)``)
so the first committed transition wins and terminal states never change.
Event payloads are built by the caller (they embed the response object); the
store only guarantees that sequence numbers are gap-free and never reused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
from ulid import monotonic as ulid

from lmspd.errors import (
    IdempotencyKeyReusedError,
    LeaseLostError,
    QueueFullError,
    SequenceConflictError,
    TaskNotCancelableError,
    TaskNotFoundError,
    TooManyBackgroundJobsError,
)
from lmspd.metrics import Metrics
from lmspd.store.conn import Conn, Row
from lmspd.store.db import Database
from lmspd.store.status import STATUSES, TERMINAL, OnRestart, TaskStatus, sources


class ResponseFields(msgspec.Struct, frozen=True, kw_only=True):
    """What a Responses API request adds to its task row."""

    kind: str = "response"
    background: bool = True
    stored: bool = True
    previous_response_id: str | None = None
    conversation: str | None = None
    expires_at: int | None = None  # a store:false background result stays readable until then
    model: str | None = None  # as asked for: on PostgreSQL only a node serving it claims the task
    cache_key: str | None = None  # its prompt_cache_key: the node holding that cache is preferred


class ResponseLimits(Protocol):
    store_max_entries: int
    store_max_bytes: int
    store_ttl_secs: int
    conversation_store_max_entries: int
    conversation_store_max_bytes: int
    conversation_store_ttl_secs: int


class TaskRecord(msgspec.Struct, kw_only=True):
    id: str
    owner: str
    type: str
    status: TaskStatus
    on_restart: OnRestart
    request: bytes
    response_id: str
    response: bytes | None
    error: bytes | None
    attempt: int
    next_seq: int
    events_expired: int
    created_at: int
    updated_at: int
    finished_at: int | None
    kind: str = "task"  # "task": made on /lmsp/v1/tasks; "response": on /v1/responses
    background: int = 1
    stored: int = 1
    previous_response_id: str | None = None
    expires_at: int | None = None
    conversation: str | None = None
    node: str | None = None  # PostgreSQL: the node that claimed it, and its lease epoch then
    epoch: int | None = None
    model: str | None = None  # PostgreSQL: the model asked for, the node holding its prompt
    cache_key: str | None = None  # cache (affinity), and when it last became queued
    affinity: str | None = None
    queued_at: float | None = None

    @classmethod
    def from_row(cls, row: Row) -> TaskRecord:
        return cls(**{k: row[k] for k in row.keys()})  # noqa: SIM118 - a row is not a Mapping


class Event(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    type: str
    data: bytes
    tokens: list[int] | None = None


class NewEvent(msgspec.Struct, frozen=True):
    type: str
    data: bytes  # the event JSON, its sequence_number included
    tokens: list[int] | None = None  # generated token ids this event carries (for resume)


# Builds an event for a task at a sequence number (run inside the write transaction, so the
# sequence number is the one the event gets).
EventBuilder = Callable[[TaskRecord, int], NewEvent]


def new_ids() -> tuple[str, str]:
    # Monotonic ULIDs: ids made in the same millisecond still sort in creation order,
    # which the newest-first task list and its cursor rely on.
    return f"task_{ulid.new()}", f"resp_{ulid.new()}"


class _Lost(Exception):
    """A transition's compare-and-set found another status: the job's savepoint undoes it."""


class _Raced(Exception):
    """Another request with the same idempotency key committed while this one was being written
    (another node's, on PostgreSQL): the job's savepoint undoes this one, which then replays."""


def _now() -> int:
    return int(time.time())


def _get(conn: Conn, task_id: str) -> TaskRecord:
    row = conn.run("get_task", {"id": task_id}).fetchone()
    if row is None:
        raise TaskNotFoundError(f"task {task_id} not found")
    return TaskRecord.from_row(row)


class Fence(msgspec.Struct, kw_only=True):
    """Whose writes these are (PostgreSQL; docs/operations.md, "Several nodes"): this node and its
    current lease epoch. A write into a task claimed under another node or epoch finds no row
    (queries_pg.sql)."""

    me: str | None = None
    epoch: int | None = None

    def params(self) -> dict[str, Any]:
        return {"me": self.me, "epoch": self.epoch}


def _append(conn: Conn, task: TaskRecord, builders: Sequence[EventBuilder], fence: Fence) -> TaskRecord:
    if not builders:  # nothing to append (a cancel from any node is such a write: never fenced)
        return _get(conn, task.id)
    seq = task.next_seq
    for build in builders:
        ev = build(task, seq)
        tokens = msgspec.json.encode(ev.tokens) if ev.tokens is not None else None
        conn.run("insert_event", {"task_id": task.id, "seq": seq, "type": ev.type, "data": ev.data, "tokens": tokens})
        seq += 1
    # RETURNING: the task as it now is, without another round trip (on PostgreSQL, each counts).
    rows = conn.run(
        "advance_seq", {"id": task.id, "new_next": seq, "expected": task.next_seq, "now": _now(), **fence.params()}
    ).fetchall()
    if len(rows) != 1:
        now = _get(conn, task.id)
        if now.node is not None and (now.node, now.epoch) != (fence.me, fence.epoch):
            raise LeaseLostError(f"task {task.id} is node {now.node}'s now: this node's lease on it was lost")
        raise SequenceConflictError(f"task {task.id}: events appended concurrently")
    return TaskRecord.from_row(rows[0])


def _rowcount(name: str, params: dict[str, Any]) -> Callable[[Conn], int]:
    def job(conn: Conn) -> int:
        return int(conn.run(name, params).rowcount)

    return job


class PurgeCounts(msgspec.Struct, kw_only=True):
    tasks_with_expired_events: int = 0
    events: int = 0
    tasks: int = 0
    idempotency_keys: int = 0


class TaskStore:
    """``metrics``: counts tasks created and finished. Each count is made inside the write
    transaction that creates or finishes the task (so a reader that sees the new status can
    already scrape it); only a failing COMMIT, which loses the whole batch, would overcount."""

    def __init__(self, db: Database, *, max_queued: int = 1000, metrics: Metrics | None = None) -> None:
        self.db = db
        self.max_queued = max_queued
        self.metrics = metrics or Metrics()
        self.fence = Fence()  # set by the node's lease (lmspd.core.cluster); unset on SQLite
        # PostgreSQL: how long a task waits for the node holding its prompt cache before this
        # node takes it (lmspd.core.cluster sets one heartbeat; docs/operations.md).
        self.affinity_hold = 0.0

    async def create(
        self,
        *,
        owner: str,
        request: bytes,
        on_restart: OnRestart,
        first_event: EventBuilder,
        idempotency: tuple[str, str] | None = None,  # (key, request fingerprint)
        response: ResponseFields | None = None,
        waiting_event: EventBuilder | None = None,
        slots: int = 0,
        max_background: int | None = None,
    ) -> tuple[TaskRecord, bool]:
        """Persist a queued task and its first event; returns (task, replayed).

        ``waiting_event`` follows the first event when ``slots`` or more tasks are already
        active (the task will wait for a slot). ``max_background`` bounds the active
        background responses; it is checked in the same transaction as the insert, so
        concurrent requests cannot overshoot it, nor (PostgreSQL) can other nodes': the job
        takes the intake lock first, and runs first in its batch, before any row lock.
        """
        task_id, response_id = new_ids()

        fence = self.fence

        def job(conn: Conn) -> tuple[TaskRecord, bool]:
            now = _now()
            conn.run("intake_lock")  # the bounds hold across nodes (queries_pg.sql)
            if idempotency is not None:
                key, fingerprint = idempotency
                row = conn.run("get_idempotency_key", {"owner": owner, "key": key}).fetchone()
                if row is not None:
                    if row["fingerprint"] != fingerprint:
                        raise IdempotencyKeyReusedError(
                            "this Idempotency-Key was used with a different request body", param="Idempotency-Key"
                        )
                    return _get(conn, row["task_id"]), True
            if conn.run("count_queued").fetchone()[0] >= self.max_queued:
                raise QueueFullError(f"the task queue is full ({self.max_queued} queued)")
            fields = response or ResponseFields(kind="task")
            limited = fields.background and max_background is not None
            if limited and conn.run("count_active_background").fetchone()[0] >= max_background:
                raise TooManyBackgroundJobsError(f"{max_background} background responses are already active")
            inserted = conn.run(
                "insert_task",
                {
                    "id": task_id,
                    "owner": owner,
                    "on_restart": on_restart,
                    "request": request,
                    "response_id": response_id,
                    "now": now,
                    **msgspec.structs.asdict(fields),
                },
            ).fetchall()[0]
            if idempotency is not None:
                key_row = {"owner": owner, "key": idempotency[0], "fingerprint": idempotency[1], "task_id": task_id}
                if conn.run("insert_idempotency_key", {**key_row, "now": now}).rowcount != 1:
                    raise _Raced
            events = [first_event]
            if waiting_event is not None and conn.run("count_active").fetchone()[0] > slots:
                events.append(waiting_event)  # counted after the insert: this task included
            task = _append(conn, TaskRecord.from_row(inserted), events, fence)
            self.metrics.tasks_created.labels(fields.kind).inc()
            return task, False

        try:
            return await self.db.writer.submit(job, first=True)
        except _Raced:
            return await self.db.writer.submit(job, first=True)  # the key is there now: this replays it

    async def get(self, task_id: str, owner: str | None = None) -> TaskRecord:
        row = await self.db.one("get_task", {"id": task_id})
        if row is None or (owner is not None and row["owner"] != owner):
            raise TaskNotFoundError(f"task {task_id} not found", param="task_id")
        return TaskRecord.from_row(row)

    async def transition(
        self,
        task_id: str,
        to: TaskStatus,
        *,
        events: Sequence[EventBuilder] = (),
        response: bytes | None = None,
        error: bytes | None = None,
        also: Callable[[Conn], object] | None = None,
        via: TaskStatus | None = None,
    ) -> TaskRecord | None:
        """Move a task to ``to`` if its current status allows; None if another transition won.
        ``also`` runs in the same transaction when the transition happens (it must not raise).
        ``via``: first through that status, in the same transaction (both or neither)."""

        def params(step: TaskStatus, response: bytes | None = None, error: bytes | None = None) -> dict[str, Any]:
            allowed = msgspec.json.encode(sorted(sources(step))).decode()
            return {"id": task_id, "to": step, "response": response, "error": error, "sources": allowed}

        steps = ([params(via)] if via else []) + [params(to, response, error)]

        fence, hold = self.fence, self.affinity_hold

        def job(conn: Conn) -> TaskRecord | None:
            for step in steps:
                query = "claim" if step["to"] == "loading" else "transition"  # out of queued: a claim
                if conn.run(query, {**step, "now": _now(), "hold": hold, **fence.params()}).rowcount != 1:
                    # Another transition committed first, or the task is terminal; an earlier
                    # step is undone with the job's savepoint.
                    raise _Lost
            if also is not None:
                also(conn)
            task = _append(conn, _get(conn, task_id), events, fence)
            if to in TERMINAL:
                self.metrics.tasks_finished.labels(to).inc()
            return task

        try:
            return await self.db.writer.submit(job)
        except _Lost:
            return None

    async def append_events(self, task_id: str, events: Sequence[EventBuilder]) -> TaskRecord:
        """Append events (group-committed with whatever else is being written)."""
        fence = self.fence  # as it is now: a lease lost before this is written fences it out
        return await self.db.writer.submit(lambda conn: _append(conn, _get(conn, task_id), events, fence))

    async def cancel(
        self,
        task_id: str,
        owner: str | None,
        *,
        final_events: Sequence[EventBuilder],
        response: bytes | None = None,
    ) -> TaskRecord:
        """docs/lmsp.md §7.3: queued → cancelled now (with ``final_events`` and the final ``response``);
        loading/running → cancelling; idempotent; 409 if finished."""

        fence = self.fence

        def job(conn: Conn) -> TaskRecord:
            # The status read may be stale by the UPDATE (another node claimed or finished the
            # task meanwhile): then read again. A status only moves forward, so this ends.
            for _ in STATUSES:
                task = _get(conn, task_id)
                if owner is not None and task.owner != owner:
                    raise TaskNotFoundError(f"task {task_id} not found", param="task_id")
                if task.status in ("cancelling", "cancelled"):
                    return task
                if task.status in TERMINAL:
                    raise TaskNotCancelableError(f"task {task_id} already {task.status}")
                queued = task.status == "queued"
                params = {"id": task_id, "to": "cancelled" if queued else "cancelling", "from": task.status}
                cur = conn.run("cancel_task", {**params, "now": _now(), "response": response if queued else None})
                if cur.rowcount == 1:
                    task = _append(conn, _get(conn, task_id), final_events if queued else [], fence)
                    if queued:
                        self.metrics.tasks_finished.labels("cancelled").inc()
                    return task
            raise SequenceConflictError(f"task {task_id}: its status kept changing under a cancel")

        return await self.db.writer.submit(job)

    async def requeue(
        self, task_id: str, *, new_attempt: bool, events: Sequence[EventBuilder] = ()
    ) -> TaskRecord | None:
        """Put a started task back in the queue (restart or engine crash); None if it had moved on."""

        fence = self.fence

        def job(conn: Conn) -> TaskRecord | None:
            cur = conn.run("requeue", {"id": task_id, "bump": int(new_attempt), "now": _now(), **fence.params()})
            return _append(conn, _get(conn, task_id), events, fence) if cur.rowcount == 1 else None

        return await self.db.writer.submit(job)

    async def get_by_response(self, response_id: str, owner: str | None = None) -> TaskRecord | None:
        row = await self.db.one("get_task_by_response", {"response_id": response_id})
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return TaskRecord.from_row(row)

    async def delete_finished_unstored(self, limit: int = 500) -> int:
        """Foreground store:false responses a crash left finished; on PostgreSQL this node's only."""
        params = {"limit": limit, **self.fence.params()}
        return await self.db.writer.submit(_rowcount("delete_finished_unstored", params))

    async def delete(self, task_id: str) -> bool:
        return await self.db.writer.submit(_rowcount("delete_task", {"id": task_id})) == 1

    async def conversation(self, owner: str, conversation: str) -> list[TaskRecord]:
        rows = await self.db.all("conversation_turns", {"owner": owner, "conversation": conversation})
        return [TaskRecord.from_row(r) for r in rows]

    async def active_background(self) -> int:
        row = await self.db.one("count_active_background")
        return int(row[0]) if row else 0

    async def enforce_response_limits(self, limits: ResponseLimits, now: int | None = None) -> int:
        """The seed's store caps: TTLs, entry counts, byte budgets. Returns rows changed."""
        now = _now() if now is None else now
        steps: list[tuple[str, dict[str, Any]]] = []
        if limits.store_ttl_secs:
            steps.append(("responses_expired", {"cutoff": now - limits.store_ttl_secs, "limit": 10_000}))
        steps.append(("responses_over_count", {"keep": limits.store_max_entries}))
        steps.append(("responses_over_bytes", {"budget": limits.store_max_bytes}))
        if limits.conversation_store_ttl_secs:
            steps.append(("conversations_expired", {"cutoff": now - limits.conversation_store_ttl_secs}))
        steps.append(("conversations_over_count", {"keep": limits.conversation_store_max_entries}))
        steps.append(("conversations_over_bytes", {"budget": limits.conversation_store_max_bytes}))
        changed = 0
        for query, params in steps:
            changed += await self.db.writer.submit(_rowcount(query, params))
        return changed

    async def status_counts(self) -> dict[str, int]:
        """How many tasks the database holds in each status (a table its triggers maintain), every
        status named, so a scrape sets a status back to zero once its last task leaves it."""
        counts = {r["status"]: int(r["n"]) for r in await self.db.all("status_counts")}
        return {status: counts.get(status, 0) for status in STATUSES}

    async def owner_status_counts(self, owner: str) -> dict[str, int]:
        """How many of ``owner``'s tasks are in each status, every status named (the console's
        summary: one token sees its own queue, never another's)."""
        rows = await self.db.all("owner_status_counts", {"owner": owner})
        counts = {r["status"]: int(r["n"]) for r in rows}
        return {status: counts.get(status, 0) for status in STATUSES}

    async def queued_ids(self, limit: int) -> list[str]:
        params = {"limit": limit, "hold": self.affinity_hold, **self.fence.params()}
        return [r["id"] for r in await self.db.all("queued_ids", params)]

    async def unfinished_ids(self) -> list[str]:
        return [r["id"] for r in await self.db.all("unfinished_ids", self.fence.params())]

    async def events_after(self, task_id: str, after: int, limit: int = 1000) -> list[Event]:
        rows = await self.db.all("events_after", {"task_id": task_id, "after": after, "limit": limit})
        return [
            Event(r["seq"], r["type"], r["data"], msgspec.json.decode(r["tokens"]) if r["tokens"] else None)
            for r in rows
        ]

    async def all_events(self, task_id: str) -> list[Event]:
        """The task's whole event log, read in pages (a resumed task's may be long)."""
        events: list[Event] = []
        after = -1
        while batch := await self.events_after(task_id, after, 5000):
            events += batch
            after = batch[-1].seq
        return events

    async def list(
        self, owner: str, *, limit: int = 20, after: str | None = None, statuses: list[str] | None = None
    ) -> list[TaskRecord]:
        filt = msgspec.json.encode(statuses).decode() if statuses else None
        params = {"owner": owner, "after": after, "limit": limit, "statuses": filt}
        rows = await self.db.all("list_tasks_by_owner", params)
        return [TaskRecord.from_row(r) for r in rows]

    async def purge(
        self,
        *,
        event_retention_secs: int,
        task_retention_secs: int,
        idempotency_retention_secs: int,
        batch: int = 500,
        now: int | None = None,
    ) -> PurgeCounts:
        """Retention (docs/lmsp.md §11.2) in small transactions, so the writer is never held for long."""
        now = _now() if now is None else now
        counts = PurgeCounts()
        steps: list[tuple[str, str, int]] = [
            ("expire_events", "tasks_with_expired_events", now - event_retention_secs),
            ("delete_expired_events", "events", 0),
            ("purge_tasks", "tasks", now - task_retention_secs),
            ("purge_idempotency_keys", "idempotency_keys", now - idempotency_retention_secs),
            ("purge_expired", "tasks", now),
        ]
        for query, field, cutoff in steps:
            while True:
                done = await self.db.writer.submit(_rowcount(query, {"cutoff": cutoff, "limit": batch}))
                setattr(counts, field, getattr(counts, field) + done)
                if done < batch:
                    break
        return counts
