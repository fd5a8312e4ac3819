"""The invariants of a chaos run, checked on the database the server left and on what the
clients were told (:mod:`harness.chaos.ledger`).

The same state checks (sequence numbers, status against the last event) run on the
database as each kill left it, as that is the state recovery starts from, and on the final
one. Each invariant yields a list of violations, in words; empty lists mean it held.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .ledger import FINAL_EVENTS, STARTED, TERMINAL, Ack, Ledger, TaskState

INVARIANTS: dict[str, str] = {
    "exists": "every acknowledged task/response exists",
    "policy": "each ends as its on_restart policy says",
    "sequence": "sequence numbers from 0, no gap or duplicate",
    "status_event": "status agrees with the last event",
    "client_events": "no event a client received differs",
    "stuck": "nothing left queued/loading/running/cancelling",
    "idempotency": "an Idempotency-Key makes exactly one task",
    "resume_text": "a resumed task's text = an uninterrupted run's",
    "integrity": "PRAGMA integrity_check is ok",
    "answers": "no 5xx, no valid request or resume refused",
    "one_node": "a task never held by two live nodes at once",
}
NODES_ONLY = {"one_node"}  # checked with --nodes (several nodes on one PostgreSQL)
SQLITE_ONLY = {"integrity"}
# The final event each terminal status goes with.
STATUS_OF_FINAL = {
    "response.completed": "succeeded",
    "response.incomplete": "succeeded",
    "response.failed": "failed",
    "response.cancelled": "cancelled",
}
RESTART_CODES = ("server_restarted", "engine_crashed")


@dataclass
class DbTask:
    id: str
    status: str
    on_restart: str
    attempt: int
    response_id: str
    next_seq: int
    error_code: str | None
    response: dict[str, Any] | None
    marker: str | None
    prompt: str  # the request's input and max_output_tokens, as JSON: equal ones generate alike


@dataclass
class DbState:
    tasks: dict[str, DbTask]
    events: dict[str, list[tuple[int, str, bytes]]]  # task id -> (seq, type, data), by seq
    keys: dict[str, str]  # Idempotency-Key -> task id
    integrity: str

    def by_response(self) -> dict[str, DbTask]:
        return {t.response_id: t for t in self.tasks.values()}


def _marker(request: dict[str, Any]) -> str | None:
    marker = (request.get("metadata") or {}).get("chaos")
    return marker if isinstance(marker, str) else None


def _prompt(request: dict[str, Any]) -> str:
    return msgspec.json.encode([request.get("input"), request.get("max_output_tokens")]).decode()


TASK_COLUMNS = "id, status, on_restart, attempt, response_id, next_seq, error, response, request"
EVENT_QUERY = "SELECT task_id, seq, type, data FROM events ORDER BY task_id, seq"
KEY_QUERY = "SELECT key, task_id FROM idempotency_keys"


def state_of(
    task_rows: Iterable[Sequence[Any]],
    event_rows: Iterable[Sequence[Any]],
    key_rows: Iterable[Sequence[Any]],
    integrity: str,
) -> DbState:
    """The rows of either database (``TASK_COLUMNS``, ``EVENT_QUERY``, ``KEY_QUERY``) as a DbState."""
    tasks: dict[str, DbTask] = {}
    for row in task_rows:
        error = msgspec.json.decode(row[6]) if row[6] else None
        request = msgspec.json.decode(row[8])
        tasks[row[0]] = DbTask(
            id=row[0],
            status=row[1],
            on_restart=row[2],
            attempt=row[3],
            response_id=row[4],
            next_seq=row[5],
            error_code=error.get("code") if isinstance(error, dict) else None,
            response=msgspec.json.decode(row[7]) if row[7] else None,
            marker=_marker(request),
            prompt=_prompt(request),
        )
    events: dict[str, list[tuple[int, str, bytes]]] = {t: [] for t in tasks}
    for task_id, seq, kind, data in event_rows:
        events.setdefault(task_id, []).append((seq, kind, bytes(data)))
    keys = {key: task_id for key, task_id in key_rows}
    return DbState(tasks, events, keys, integrity)


def read_db(path: Path, *, integrity: bool = True) -> DbState:
    """The whole database, read-only: a crash's WAL is read as recovery will read it, and
    nothing is checkpointed or written before the server opens it again."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tasks = conn.execute(f"SELECT {TASK_COLUMNS} FROM tasks").fetchall()
        events, keys = conn.execute(EVENT_QUERY).fetchall(), conn.execute(KEY_QUERY).fetchall()
        result = conn.execute("PRAGMA integrity_check").fetchall() if integrity else [("not checked",)]
        return state_of(tasks, events, keys, "; ".join(str(r[0]) for r in result))
    finally:
        conn.close()


def sequence_violations(db: DbState) -> list[str]:
    """Each log is 0, 1, ... next_seq - 1, starts with ``response.created``, and each event's
    ``sequence_number`` is its position."""
    out = []
    for task_id, task in db.tasks.items():
        log = db.events.get(task_id, [])
        seqs = [seq for seq, _, _ in log]
        if seqs != list(range(task.next_seq)):
            missing = sorted(set(range(task.next_seq)) - set(seqs))
            extra = sorted({s for s in seqs if seqs.count(s) > 1} | (set(seqs) - set(range(task.next_seq))))
            out.append(
                f"{task_id}: {len(seqs)} events, next_seq {task.next_seq}, missing {missing[:5]}, extra {extra[:5]}"
            )
            continue
        if log and log[0][1] != "response.created":
            out.append(f"{task_id}: event 0 is {log[0][1]}")
        numbers = [msgspec.json.decode(data).get("sequence_number") for _, _, data in log]
        if numbers != seqs:
            bad = next(i for i, (n, s) in enumerate(zip(numbers, seqs, strict=True)) if n != s)
            out.append(f"{task_id}: event {bad} says sequence_number {numbers[bad]}")
    return out


def status_event_violations(db: DbState) -> list[str]:
    """A final event iff a terminal status, the matching one, exactly once and last."""
    out = []
    for task_id, task in db.tasks.items():
        types = [kind for _, kind, _ in db.events.get(task_id, [])]
        finals = [i for i, kind in enumerate(types) if kind in FINAL_EVENTS]
        if task.status in TERMINAL:
            if not types or types[-1] not in FINAL_EVENTS:
                out.append(f"{task_id}: {task.status} but its last event is {types[-1] if types else None}")
            elif STATUS_OF_FINAL[types[-1]] != task.status:
                out.append(f"{task_id}: {task.status} but its final event is {types[-1]}")
            if len(finals) > 1:
                out.append(f"{task_id}: {len(finals)} final events")
        elif finals:
            out.append(f"{task_id}: {task.status} with a final event {types[finals[0]]} at {finals[0]}")
    return out


def _final_text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "")
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
    )


def resumed_mid_generation(db: DbState) -> dict[str, str]:
    """Resume tasks that succeeded after a restart cut their text (a ``response.in_progress``
    after a delta): task id -> prompt. The final run makes an uninterrupted reference of each."""
    found = {}
    for task in db.tasks.values():
        if task.on_restart == "resume" and task.status == "succeeded":
            types = [kind for _, kind, _ in db.events.get(task.id, [])]
            first = types.index("response.output_text.delta") if "response.output_text.delta" in types else None
            if first is not None and "response.in_progress" in types[first:]:
                found[task.id] = task.prompt
    return found


def _resume_text(db: DbState) -> tuple[list[str], int]:
    """With greedy decoding a resumed task's text is an uninterrupted run's: the reference
    tasks (marker ``ref-``, run in the final, clean run) of the same input."""
    references = {
        t.prompt: _final_text(t.response)
        for t in db.tasks.values()
        if (t.marker or "").startswith("ref-") and t.status == "succeeded" and t.response is not None
    }
    out, resumed = [], resumed_mid_generation(db)
    for task_id, prompt in resumed.items():
        response = db.tasks[task_id].response
        if prompt not in references:
            out.append(f"{task_id}: no reference run of {prompt[:60]}")
        elif response is None or _final_text(response) != references[prompt]:
            out.append(f"{task_id}: resumed text differs from an uninterrupted run of {prompt[:60]}")
    return out, len(resumed)


# A started task's holder as a sample of the tasks table shows it: (node, lease epoch, queued_at).
Holder = tuple[str, int, float | None]


def holder_faults(before: dict[str, Holder], now: dict[str, Holder], live: dict[str, int]) -> tuple[int, list[str]]:
    """Two samples of who holds each started task (``live``: node -> epoch of each live lease,
    in the second sample). A task may change node only through the queue (its queued_at moved:
    its holder let it go) or when its holder's lease is gone: expired, taken over (the row
    deleted) or renewed under a new epoch. Any other change means two live nodes held it at
    once. Returns the changes seen and the faults among them."""
    changes, faults = 0, []
    for task_id, (node, epoch, queued_at) in now.items():
        old = before.get(task_id)
        if old is None or old[0] == node:
            continue
        changes += 1
        if old[2] == queued_at and live.get(old[0]) == old[1]:
            faults.append(f"{task_id}: moved from {old[0]} (epoch {old[1]}, lease live) to {node} (epoch {epoch})")
    return changes, faults


def snapshot_of(db: DbState) -> tuple[dict[str, TaskState], dict[str, list[str]]]:
    """What a kill left: each task's status and attempt, and the state invariants' violations."""
    tasks = {t.id: TaskState(t.status, t.attempt) for t in db.tasks.values()}
    violations = {
        "sequence": sequence_violations(db),
        "status_event": status_event_violations(db),
        "integrity": [] if db.integrity in ("ok", "not checked") else [db.integrity],
    }
    return tasks, violations


@dataclass
class Report:
    checked: dict[str, int] = field(default_factory=dict)
    violations: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in INVARIANTS})
    lost: int = 0
    events: int = 0
    interrupted_by_kill: int = 0  # tasks that were loading/running at some kill
    restarts: dict[str, int] = field(default_factory=dict)  # lmsp.attempt.restarted by reason

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())


def _policy(ack: Ack, task: DbTask, log: list[tuple[int, str, bytes]], starts: set[int], ledger: Ledger) -> list[str]:
    """How ``task`` ended against its policy. ``starts``: the attempts it was loading or
    running in at some kill (each a server restart it went through while started)."""
    where = f"{task.id} ({ack.kind}, {task.on_restart})"
    if task.status == "cancelled":
        return [] if ack.cancel_sent else [f"{where}: cancelled, but no client cancelled it"]
    if ack.must_cancel:
        return [f"{where}: a cancel answered cancelling, but it ended {task.status}"]
    restarts = [msgspec.json.decode(data) for _, kind, data in log if kind == "lmsp.attempt.restarted"]
    by_reason = [r.get("reason") for r in restarts]
    out = []
    if task.on_restart == "fail":
        if task.status == "failed":
            if task.error_code not in RESTART_CODES:
                out.append(f"{where}: failed with {task.error_code}")
            elif task.error_code == "server_restarted" and not starts:
                out.append(f"{where}: failed server_restarted, but no kill found it started")
            elif task.error_code == "engine_crashed" and not ledger.engine_kills:
                out.append(f"{where}: failed engine_crashed, but the engine was never killed")
        elif starts:
            out.append(f"{where}: started at a kill, but ended {task.status}, not failed server_restarted")
        if restarts:
            out.append(f"{where}: {len(restarts)} restarts under policy fail")
    else:
        if task.status != "succeeded":
            out.append(f"{where}: ended {task.status} ({task.error_code})")
        if task.on_restart == "resume" and (restarts or task.attempt != 1):
            out.append(f"{where}: attempt {task.attempt}, {len(restarts)} restarts under policy resume")
        if task.on_restart == "retry":
            if task.attempt != 1 + len(restarts) or [r.get("attempt") for r in restarts] != list(
                range(2, task.attempt + 1)
            ):
                out.append(f"{where}: attempt {task.attempt} after restarts {[r.get('attempt') for r in restarts]}")
            if by_reason.count("server_restarted") != len(starts):
                out.append(
                    f"{where}: {by_reason.count('server_restarted')} server restarts, started at {len(starts)} kills"
                )
            if by_reason.count("engine_crashed") > ledger.engine_kills:
                out.append(f"{where}: {by_reason.count('engine_crashed')} engine restarts, {ledger.engine_kills} kills")
            if task.attempt > 1 + ledger.cycles + ledger.engine_kills:
                out.append(f"{where}: attempt {task.attempt} exceeds the bound")
        if task.status == "succeeded" and task.response is not None:
            # The final text is the deltas of the last attempt: a resume continued, repeating nothing.
            last = max((i for i, (_, kind, _) in enumerate(log) if kind == "lmsp.attempt.restarted"), default=-1)
            deltas = [msgspec.json.decode(d) for _, kind, d in log[last + 1 :] if kind == "response.output_text.delta"]
            if "".join(d.get("delta", "") for d in deltas) != _final_text(task.response):
                out.append(f"{where}: its final text is not the text its events streamed")
    return out


def _client_events(db: DbState, ledger: Ledger, tasks: dict[str, DbTask]) -> tuple[list[str], int]:
    """Every event a reader received is in the log, the same. Returns violations and losses."""
    out, lost = [], 0
    for rid, got in ledger.received.items():
        task = tasks.get(rid)
        log = {seq: (kind, data) for seq, kind, data in db.events.get(task.id, [])} if task else {}
        for seq, (kind, data) in got.events.items():
            if seq not in log:
                lost += 1
                out.append(f"{rid}: event {seq} ({kind}) was received but is not in the log")
            elif log[seq] != (kind, data) and not _same_cancel(log[seq], (kind, data)):
                out.append(f"{rid}: event {seq} was received as {kind} {data[:80]!r}, the log has {log[seq][0]}")
    for conn in ledger.connections:
        expect = list(range(conn.after + 1, conn.after + 1 + len(conn.seqs)))
        if conn.seqs != expect:
            bad = next(i for i, (s, e) in enumerate(zip(conn.seqs, expect, strict=True)) if s != e)
            what = "duplicate" if conn.seqs[bad] < expect[bad] else "gap"
            out.append(
                f"{conn.response_id}: a {what} on a stream after {conn.after}: {conn.seqs[max(0, bad - 2) : bad + 2]}"
            )
    return out, lost


def _same_cancel(logged: tuple[str, bytes], got: tuple[str, bytes]) -> bool:
    """/v1 streams show LMSP's ``response.cancelled`` as ``response.incomplete``, same payload."""
    if logged[0] != "response.cancelled" or got[0] != "response.incomplete":
        return False
    a, b = msgspec.json.decode(logged[1]), msgspec.json.decode(got[1])
    return bool(a.get("response") == b.get("response") and a.get("sequence_number") == b.get("sequence_number"))


def check(db: DbState, ledger: Ledger) -> Report:
    report = Report()
    v = report.violations
    tasks = db.by_response()
    report.events = sum(len(log) for log in db.events.values())
    # Each started snapshot of a task: one per attempt (a kill during recovery finds the same one).
    starts: dict[str, set[int]] = {}
    for snap in ledger.snapshots:
        for inv, found in snap.violations.items():
            v[inv] += [f"at kill {snap.cycle + 1}: {x}" for x in found]
        for task_id, state in snap.tasks.items():
            if state.status in STARTED:
                starts.setdefault(task_id, set()).add(state.attempt)
    report.interrupted_by_kill = len(starts)
    for ack in ledger.acks.values():
        task = tasks.get(ack.response_id)
        if task is None or (ack.task_id is not None and ack.task_id != task.id):
            report.lost += 1
            v["exists"].append(f"{ack.kind} {ack.task_id or ack.response_id}: acknowledged, not in the database")
            continue
        v["policy"] += _policy(ack, task, db.events.get(task.id, []), starts.get(task.id, set()), ledger)
    v["exists"] += ledger.api_missing
    report.checked["exists"] = report.checked["policy"] = len(ledger.acks)
    v["sequence"] += sequence_violations(db)
    v["status_event"] += status_event_violations(db)
    report.checked["sequence"] = report.checked["status_event"] = len(db.tasks) * (1 + len(ledger.snapshots))
    found, lost = _client_events(db, ledger, tasks)
    v["client_events"] += found
    report.lost += lost
    report.checked["client_events"] = sum(len(r.events) for r in ledger.received.values())
    v["stuck"] += [f"{t.id}: still {t.status}" for t in db.tasks.values() if t.status not in TERMINAL]
    report.checked["stuck"] = len(db.tasks)
    v["idempotency"] += ledger.idempotency_faults
    marked: dict[str, list[str]] = {}
    for t in db.tasks.values():
        if t.marker is not None:
            marked.setdefault(t.marker, []).append(t.id)
    keyed = [a for a in ledger.acks.values() if a.key is not None]
    for ack in keyed:
        made = marked.get(ack.marker, [])
        if len(made) != 1 or db.keys.get(ack.key or "") != made[0]:
            v["idempotency"].append(f"key {ack.key}: tasks {made}, key names {db.keys.get(ack.key or '')}")
    report.checked["idempotency"] = len(keyed) + ledger.replays
    v["resume_text"], report.checked["resume_text"] = _resume_text(db)
    if db.integrity not in ("ok", "not checked"):
        v["integrity"].append(db.integrity)
    report.checked["integrity"] = 0 if db.integrity == "not checked" else 1 + len(ledger.snapshots)
    v["answers"] += ledger.errors
    report.checked["answers"] = ledger.requests
    v["one_node"] += ledger.holder_faults
    report.checked["one_node"] = ledger.holder_changes
    for log in db.events.values():
        for _, kind, data in log:
            if kind == "lmsp.attempt.restarted":
                reason = str(msgspec.json.decode(data).get("reason"))
                report.restarts[reason] = report.restarts.get(reason, 0) + 1
    return report
