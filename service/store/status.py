"""The task state machine of docs/lmsp.md §7.2: one definition for Python and for the SQL in queries.sql."""

from __future__ import annotations

from typing import Literal

TaskStatus = Literal["queued", "loading", "running", "cancelling", "succeeded", "failed", "cancelled"]
OnRestart = Literal["fail", "retry", "resume"]

STATUSES: tuple[TaskStatus, ...] = ("queued", "loading", "running", "cancelling", "succeeded", "failed", "cancelled")
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
ACTIVE: frozenset[str] = frozenset(STATUSES) - TERMINAL  # accepted and not finished
STARTED: frozenset[str] = frozenset({"loading", "running"})  # what a restart or crash interrupts
# status -> statuses it may move to
TRANSITIONS: dict[str, frozenset[str]] = {
    "queued": frozenset({"loading", "cancelled", "failed"}),
    "loading": frozenset({"running", "cancelling", "failed"}),
    "running": frozenset({"succeeded", "failed", "cancelling"}),
    "cancelling": frozenset({"cancelled"}),
}


def sources(to: str) -> frozenset[str]:
    """The statuses a task may move to ``to`` from."""
    return frozenset(s for s, nexts in TRANSITIONS.items() if to in nexts)


def sql_list(statuses: frozenset[str]) -> str:
    """A SQL list literal, e.g. ``('cancelling', 'loading')``, in a stable order."""
    return "(" + ", ".join(f"'{s}'" for s in STATUSES if s in statuses) + ")"
