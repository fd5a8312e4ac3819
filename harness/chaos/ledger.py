"""What the clients of a chaos run were told and saw, kept in the harness process.

The checks compare this with the database the server left: everything acknowledged must be
there, and every event a client received must be there unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["task", "background", "stream"]
Policy = Literal["fail", "retry", "resume"]

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
STARTED = frozenset({"loading", "running"})
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})


@dataclass
class Ack:
    """One acknowledged piece of work: a 202 task, a /v1 background response (200 ``queued``) or
    a /v1 stream whose ``response.created`` arrived."""

    kind: Kind
    response_id: str
    task_id: str | None  # known for LMSP tasks; the checks find the others' by response id
    policy: Policy
    marker: str  # unique text in the request's metadata, to find every task a request made
    key: str | None = None  # its Idempotency-Key
    cancel_sent: bool = False  # a cancel was sent (answered or not: it may have been committed)
    must_cancel: bool = False  # a cancel was answered with cancelling/cancelled: it must end cancelled


@dataclass
class Pending:
    """A create sent with an Idempotency-Key whose answer never came: sent again next cycle."""

    kind: Kind
    policy: Policy
    marker: str
    key: str
    path: str
    body: bytes


@dataclass
class Received:
    """What readers received of one response's event log, by sequence number."""

    events: dict[int, tuple[str, bytes]] = field(default_factory=dict)  # seq -> (type, data)
    final: bool = False  # a reader got its final event

    @property
    def last(self) -> int:
        return max(self.events, default=-1)


@dataclass
class Connection:
    """One SSE connection: where it asked to start and the sequence numbers it got, in order."""

    response_id: str
    after: int
    seqs: list[int] = field(default_factory=list)


@dataclass
class TaskState:
    """One task row at a kill (the state recovery starts from)."""

    status: str
    attempt: int


@dataclass
class Snapshot:
    """The database right after a kill, before the restart."""

    cycle: int
    tasks: dict[str, TaskState]  # task id -> state
    violations: dict[str, list[str]]  # invariant -> what was wrong in this state


@dataclass
class Ledger:
    acks: dict[str, Ack] = field(default_factory=dict)  # response id -> ack
    received: dict[str, Received] = field(default_factory=dict)  # response id -> events received
    connections: list[Connection] = field(default_factory=list)
    idempotency_faults: list[str] = field(default_factory=list)  # a replay that named another task
    snapshots: list[Snapshot] = field(default_factory=list)
    unanswered: dict[str, Pending] = field(default_factory=dict)  # by key
    errors: list[str] = field(default_factory=list)  # answers no valid request should get (5xx, ...)
    api_missing: list[str] = field(default_factory=list)  # acknowledged, but the API says 404 at the end
    cycles: int = 0
    early_kills: int = 0  # kills before the server was ready
    term_kills: int = 0  # kills during a clean (SIGTERM) shutdown
    engine_kills: int = 0
    running_at_engine_kills: int = 0
    sse_resumes: int = 0  # connections that resumed (Last-Event-ID, after, starting_after)
    replays: int = 0  # idempotent retries answered with the original task
    cancels: int = 0
    requests: int = 0  # sent by the load (creates, SSE connections, cancels)
    refused: dict[int, int] = field(default_factory=dict)  # status -> count of refused submissions
    # --nodes (harness/chaos/nodes.py): nodes killed, and what the sampler of holders saw.
    node_kills: int = 0
    node_kills_taken_over: int = 0  # kills whose node came back only after a survivor took over
    running_at_node_kills: int = 0
    holder_samples: int = 0
    holder_changes: int = 0  # a started task seen held by another node than at the sample before
    holder_faults: list[str] = field(default_factory=list)

    def receive(self, response_id: str) -> Received:
        return self.received.setdefault(response_id, Received())
