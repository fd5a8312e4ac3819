"""The chaos harness's invariant checker (bench/chaos/checks.py) on small synthetic databases:
a clean run passes, and each kind of damage is found by the invariant meant to find it, so
a chaos run that reports zero violations has checks that can fail."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench.chaos.checks import check, read_db, snapshot_of
from bench.chaos.ledger import Ack, Connection, Ledger, Snapshot, TaskState
from service.store.migrate import migrate

RESPONSE = {"id": "resp_a", "status": "completed", "output": [{"type": "message", "content": [{"text": "Hi there"}]}]}
EVENTS: list[dict[str, Any]] = [
    {"type": "response.created", "response": {"id": "resp_a", "status": "queued"}},
    {"type": "response.in_progress", "response": {"id": "resp_a", "status": "in_progress"}},
    {"type": "response.output_text.delta", "delta": "Hi"},
    {"type": "response.output_text.delta", "delta": " there"},
    {"type": "response.completed", "response": RESPONSE},
]


def encode(seq: int, event: dict[str, Any]) -> bytes:
    return msgspec.json.encode({**event, "sequence_number": seq})


class Run:
    """A finished chaos run in miniature: one resume task, read whole by one client."""

    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "lmspd.db"
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        migrate(self.conn)
        request = msgspec.json.encode({"input": "Hi", "metadata": {"chaos": "m1"}})
        self.conn.execute(
            "INSERT INTO tasks (id, owner, status, on_restart, request, response_id, response, next_seq, "
            "created_at, updated_at) VALUES ('task_a', '', 'succeeded', 'resume', ?, 'resp_a', ?, 5, 0, 0)",
            (request, msgspec.json.encode(RESPONSE)),
        )
        self.conn.execute("INSERT INTO idempotency_keys VALUES ('', 'k1', 'f', 'task_a', 0)")
        for seq, event in enumerate(EVENTS):
            self.sql(
                "INSERT INTO events (task_id, seq, type, data) VALUES ('task_a', ?, ?, ?)",
                seq,
                event["type"],
                encode(seq, event),
            )
        self.ledger = Ledger(cycles=1)
        self.ledger.acks["resp_a"] = Ack("task", "resp_a", "task_a", "resume", "m1", key="k1")
        got = self.ledger.receive("resp_a")
        got.events = {seq: (e["type"], encode(seq, e)) for seq, e in enumerate(EVENTS)}
        got.final = True
        self.ledger.connections.append(Connection("resp_a", -1, [0, 1, 2]))
        self.ledger.connections.append(Connection("resp_a", 2, [3, 4]))

    def sql(self, statement: str, *params: Any) -> None:
        self.conn.execute(statement, params)

    def violated(self) -> set[str]:
        report = check(read_db(self.path), self.ledger)
        return {k for k, found in report.violations.items() if found}


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path)


def test_a_clean_run_passes(run: Run) -> None:
    report = check(read_db(run.path), run.ledger)
    assert report.ok, report.violations
    assert report.lost == 0 and report.events == 5
    assert report.checked["client_events"] == 5


def gap(r: Run) -> None:
    r.sql("DELETE FROM events WHERE seq = 3")


def duplicate_in_log(r: Run) -> None:
    r.sql("UPDATE events SET data = ? WHERE seq = 3", encode(2, EVENTS[3]))


def duplicate_on_a_stream(r: Run) -> None:
    r.ledger.connections.append(Connection("resp_a", 1, [2, 2, 3]))


def gap_on_a_stream(r: Run) -> None:
    r.ledger.connections.append(Connection("resp_a", 1, [2, 4]))


def succeeded_without_final_event(r: Run) -> None:
    r.sql("DELETE FROM events WHERE seq = 4")
    r.sql("UPDATE tasks SET next_seq = 4")
    del r.ledger.received["resp_a"].events[4]
    r.ledger.connections[-1].seqs = [3]


def running_with_final_event(r: Run) -> None:
    r.sql("UPDATE tasks SET status = 'running'")


def final_event_of_another_status(r: Run) -> None:
    r.sql("UPDATE tasks SET status = 'failed'")


def received_event_differs(r: Run) -> None:
    r.ledger.received["resp_a"].events[2] = ("response.output_text.delta", encode(2, {**EVENTS[2], "delta": "Ho"}))


def received_event_lost(r: Run) -> None:
    r.ledger.received["resp_a"].events[5] = ("response.output_text.delta", encode(5, EVENTS[2]))


def acknowledged_task_lost(r: Run) -> None:
    r.ledger.acks["resp_b"] = Ack("background", "resp_b", None, "fail", "m2")


def fail_task_started_at_a_kill_succeeded(r: Run) -> None:
    r.sql("UPDATE tasks SET on_restart = 'fail'")
    r.ledger.acks["resp_a"].policy = "fail"
    r.ledger.snapshots.append(Snapshot(0, {"task_a": TaskState("running", 1)}, {}))


def resume_task_restarted(r: Run) -> None:
    r.sql("UPDATE tasks SET attempt = 2")


def final_text_repeats(r: Run) -> None:
    text = {**RESPONSE, "output": [{"type": "message", "content": [{"text": "HiHi there"}]}]}
    r.sql("UPDATE tasks SET response = ?", msgspec.json.encode(text))


def cancelled_by_nobody(r: Run) -> None:
    r.sql("UPDATE tasks SET status = 'cancelled'")
    cancelled = {"type": "response.cancelled", "response": RESPONSE}
    r.sql("UPDATE events SET type = 'response.cancelled', data = ? WHERE seq = 4", encode(4, cancelled))
    r.ledger.received["resp_a"].events[4] = ("response.cancelled", encode(4, cancelled))


def left_running(r: Run) -> None:
    r.sql("DELETE FROM events WHERE seq = 4")
    r.sql("UPDATE tasks SET status = 'running', next_seq = 4")
    del r.ledger.received["resp_a"].events[4]
    r.ledger.connections[-1].seqs = [3]


def key_made_two_tasks(r: Run) -> None:
    r.sql(
        "INSERT INTO tasks (id, owner, status, on_restart, request, response_id, next_seq, created_at, updated_at) "
        "SELECT 'task_b', owner, status, on_restart, request, 'resp_b', next_seq, 0, 0 FROM tasks"
    )
    r.sql("INSERT INTO events (task_id, seq, type, data) SELECT 'task_b', seq, type, data FROM events")


def server_error(r: Run) -> None:
    r.ledger.errors.append("POST /lmsp/v1/tasks: 500 boom")


@pytest.mark.parametrize(
    ("damage", "found_by"),
    [
        (gap, {"sequence", "client_events", "policy"}),  # a client saw it, and the text lost it
        (duplicate_in_log, {"sequence", "client_events"}),
        (duplicate_on_a_stream, {"client_events"}),
        (gap_on_a_stream, {"client_events"}),
        (succeeded_without_final_event, {"status_event"}),
        (running_with_final_event, {"status_event", "stuck", "policy"}),
        (final_event_of_another_status, {"status_event", "policy"}),
        (received_event_differs, {"client_events"}),
        (received_event_lost, {"client_events"}),
        (acknowledged_task_lost, {"exists"}),
        (fail_task_started_at_a_kill_succeeded, {"policy"}),
        (resume_task_restarted, {"policy"}),
        (final_text_repeats, {"policy"}),
        (cancelled_by_nobody, {"policy"}),
        (left_running, {"stuck", "policy"}),
        (key_made_two_tasks, {"idempotency"}),
        (server_error, {"answers"}),
    ],
)
def test_damage_is_found(run: Run, damage: Callable[[Run], None], found_by: set[str]) -> None:
    damage(run)
    assert run.violated() == found_by


def test_a_kill_snapshot_is_checked_too(run: Run) -> None:
    """The state a kill left (what recovery starts from) is held to the same invariants."""
    run.sql("UPDATE tasks SET status = 'running'")  # a final event committed without its status
    tasks, found = snapshot_of(read_db(run.path))
    run.sql("UPDATE tasks SET status = 'succeeded'")
    run.ledger.snapshots.append(Snapshot(0, tasks, found))
    assert run.violated() == {"status_event"}
