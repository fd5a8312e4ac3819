"""The chaos harness's invariant checker (harness/chaos/checks.py) on small synthetic databases:
a clean run passes, and each kind of damage is found by the invariant meant to find it, so
a chaos run that reports zero violations has checks that can fail."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from harness.chaos.checks import Holder, check, holder_faults, read_db, snapshot_of
from harness.chaos.ledger import Ack, Connection, Ledger, Policy, Snapshot, TaskState
from lmspd.store.migrate import migrate


def response(rid: str, text: str) -> dict[str, Any]:
    return {"id": rid, "status": "completed", "output": [{"type": "message", "content": [{"text": text}]}]}


def events(rid: str, *deltas: str) -> list[dict[str, Any]]:
    """A log: created, then per delta a ``response.in_progress`` (a new start: a resume after
    the first) and the delta, then completed."""
    out: list[dict[str, Any]] = [{"type": "response.created", "response": {"id": rid, "status": "queued"}}]
    for delta in deltas:
        out.append({"type": "response.in_progress", "response": {"id": rid, "status": "in_progress"}})
        out.append({"type": "response.output_text.delta", "delta": delta})
    return [*out, {"type": "response.completed", "response": response(rid, "".join(deltas))}]


# The task under test: resumed once mid-text (seq 3 is the second response.in_progress).
EVENTS = events("resp_a", "Hi", " there")


def encode(seq: int, event: dict[str, Any]) -> bytes:
    return msgspec.json.encode({**event, "sequence_number": seq})


class Run:
    """A finished chaos run in miniature: a resume task resumed mid-text and read whole by a
    client over two connections, and the final run's uninterrupted reference of its input."""

    def __init__(self, tmp: Path) -> None:
        self.path = tmp / "lmspd.db"
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        self.conn.execute("PRAGMA synchronous = OFF")  # a scratch database: no fsync per migration
        migrate(self.conn)
        self.ledger = Ledger(cycles=1)
        self.add("task_a", "resp_a", "m1", "resume", EVENTS)
        self.sql("INSERT INTO idempotency_keys VALUES ('', 'k1', 'f', 'task_a', 0)")
        self.ledger.acks["resp_a"].key = "k1"
        self.add("task_r", "resp_r", "ref-0", "fail", events("resp_r", "Hi there"))
        got = self.ledger.receive("resp_a")
        got.events = {seq: (e["type"], encode(seq, e)) for seq, e in enumerate(EVENTS)}
        got.final = True
        self.ledger.connections.append(Connection("resp_a", -1, [0, 1, 2]))
        self.ledger.connections.append(Connection("resp_a", 2, [3, 4, 5]))

    def add(self, task_id: str, rid: str, marker: str, policy: Policy, log: list[dict[str, Any]]) -> None:
        request = msgspec.json.encode({"input": "Hi", "max_output_tokens": 8, "metadata": {"chaos": marker}})
        self.sql(
            "INSERT INTO tasks (id, owner, status, on_restart, request, response_id, response, next_seq, "
            "created_at, updated_at) VALUES (?, '', 'succeeded', ?, ?, ?, ?, ?, 0, 0)",
            task_id,
            policy,
            request,
            rid,
            msgspec.json.encode(log[-1]["response"]),
            len(log),
        )
        for seq, event in enumerate(log):
            insert = "INSERT INTO events (task_id, seq, type, data) VALUES (?, ?, ?, ?)"
            self.sql(insert, task_id, seq, event["type"], encode(seq, event))
        self.ledger.acks[rid] = Ack("task", rid, task_id, policy, marker)

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
    assert report.lost == 0 and report.events == 10
    assert report.checked["client_events"] == 6 and report.checked["resume_text"] == 1


def gap(r: Run) -> None:
    r.sql("DELETE FROM events WHERE task_id = 'task_a' AND seq = 4")


def duplicate_in_log(r: Run) -> None:
    r.sql("UPDATE events SET data = ? WHERE task_id = 'task_a' AND seq = 4", encode(3, EVENTS[4]))


def duplicate_on_a_stream(r: Run) -> None:
    r.ledger.connections.append(Connection("resp_a", 1, [2, 2, 3]))


def gap_on_a_stream(r: Run) -> None:
    r.ledger.connections.append(Connection("resp_a", 1, [2, 4]))


def succeeded_without_final_event(r: Run) -> None:
    r.sql("DELETE FROM events WHERE task_id = 'task_a' AND seq = 5")
    r.sql("UPDATE tasks SET next_seq = 5 WHERE id = 'task_a'")
    del r.ledger.received["resp_a"].events[5]
    r.ledger.connections[-1].seqs = [3, 4]


def running_with_final_event(r: Run) -> None:
    r.sql("UPDATE tasks SET status = 'running' WHERE id = 'task_a'")


def final_event_of_another_status(r: Run) -> None:
    r.sql("UPDATE tasks SET status = 'failed' WHERE id = 'task_a'")


def received_event_differs(r: Run) -> None:
    r.ledger.received["resp_a"].events[2] = ("response.output_text.delta", encode(2, {**EVENTS[2], "delta": "Ho"}))


def received_event_lost(r: Run) -> None:
    r.ledger.received["resp_a"].events[6] = ("response.output_text.delta", encode(6, EVENTS[2]))


def acknowledged_task_lost(r: Run) -> None:
    r.ledger.acks["resp_b"] = Ack("background", "resp_b", None, "fail", "m2")


def fail_task_started_at_a_kill_succeeded(r: Run) -> None:
    r.sql("UPDATE tasks SET on_restart = 'fail' WHERE id = 'task_a'")
    r.ledger.acks["resp_a"].policy = "fail"
    r.ledger.snapshots.append(Snapshot(0, {"task_a": TaskState("running", 1)}, {}))


def resume_task_restarted(r: Run) -> None:
    r.sql("UPDATE tasks SET attempt = 2 WHERE id = 'task_a'")


def final_text_repeats(r: Run) -> None:
    r.sql("UPDATE tasks SET response = ? WHERE id = 'task_a'", msgspec.json.encode(response("resp_a", "HiHi there")))


def cancelled_by_nobody(r: Run) -> None:
    r.sql("UPDATE tasks SET status = 'cancelled' WHERE id = 'task_a'")
    cancelled = {"type": "response.cancelled", "response": response("resp_a", "Hi there")}
    update = "UPDATE events SET type = 'response.cancelled', data = ? WHERE task_id = 'task_a' AND seq = 5"
    r.sql(update, encode(5, cancelled))
    r.ledger.received["resp_a"].events[5] = ("response.cancelled", encode(5, cancelled))


def left_running(r: Run) -> None:
    r.sql("DELETE FROM events WHERE task_id = 'task_a' AND seq = 5")
    r.sql("UPDATE tasks SET status = 'running', next_seq = 5 WHERE id = 'task_a'")
    del r.ledger.received["resp_a"].events[5]
    r.ledger.connections[-1].seqs = [3, 4]


def key_made_two_tasks(r: Run) -> None:
    """A second task from the same keyed request (its marker), whole and valid otherwise."""
    columns = "owner, status, on_restart, request, response, next_seq, created_at, updated_at"
    r.sql(
        f"INSERT INTO tasks (id, response_id, {columns}) "
        f"SELECT 'task_b', 'resp_b', {columns} FROM tasks WHERE id = 'task_a'"
    )
    r.sql("INSERT INTO events SELECT 'task_b', seq, type, data, tokens FROM events WHERE task_id = 'task_a'")


def reference_differs(r: Run) -> None:
    r.sql("UPDATE tasks SET response = ? WHERE id = 'task_r'", msgspec.json.encode(response("resp_r", "Hi where")))


def no_reference(r: Run) -> None:
    r.sql("DELETE FROM events WHERE task_id = 'task_r'")
    r.sql("DELETE FROM tasks WHERE id = 'task_r'")
    del r.ledger.acks["resp_r"]


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
        (final_text_repeats, {"policy", "resume_text"}),
        (cancelled_by_nobody, {"policy"}),
        (left_running, {"stuck", "policy"}),
        (key_made_two_tasks, {"idempotency"}),
        (reference_differs, {"resume_text"}),
        (no_reference, {"resume_text"}),
        (server_error, {"answers"}),
    ],
)
def test_damage_is_found(run: Run, damage: Callable[[Run], None], found_by: set[str]) -> None:
    damage(run)
    assert run.violated() == found_by


def test_a_kill_snapshot_is_checked_too(run: Run) -> None:
    """The state a kill left (what recovery starts from) is held to the same invariants."""
    run.sql("UPDATE tasks SET status = 'running' WHERE id = 'task_a'")  # a final event without its status
    tasks, found = snapshot_of(read_db(run.path))
    run.sql("UPDATE tasks SET status = 'succeeded' WHERE id = 'task_a'")
    run.ledger.snapshots.append(Snapshot(0, tasks, found))
    assert run.violated() == {"status_event"}


def test_a_task_changes_node_only_through_the_queue_or_a_lost_lease() -> None:
    """--nodes: the sampler's rule (``holder_faults``). Taken over (its holder's lease gone or
    renewed under a new epoch) or requeued (queued_at moved): fine; moved while its holder's
    lease is live, under the same epoch, without going through the queue: two nodes held it."""
    before: dict[str, Holder] = {"t1": ("n1", 7, 1.0), "t2": ("n1", 7, 1.0), "t3": ("n2", 8, 1.0), "t4": ("n2", 8, 1.0)}
    now: dict[str, Holder] = {
        "t1": ("n2", 8, 1.0),  # n1's lease is gone (taken over): fine
        "t2": ("n3", 9, 2.0),  # requeued, then claimed by n3: fine
        "t3": ("n2", 9, 1.0),  # its own node again, under a new epoch: no change of node
        "t4": ("n3", 9, 1.0),  # n2's lease is live under the same epoch: two nodes
        "t5": ("n1", 10, 3.0),  # first seen: nothing to compare
    }
    changes, faults = holder_faults(before, now, {"n2": 8, "n3": 9})
    assert changes == 3
    assert faults == ["t4: moved from n2 (epoch 8, lease live) to n3 (epoch 9)"]
    assert holder_faults(before, now, {"n2": 9, "n3": 9}) == (3, [])  # n2 joined again: its old run's lease is gone
