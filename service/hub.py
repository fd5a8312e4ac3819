"""Wakes event-stream readers when a task's events have been committed.

Readers take the current signal *before* reading the database and wait on it
after, so an event committed in between is never missed.
"""

from __future__ import annotations

import asyncio


class Hub:
    def __init__(self) -> None:
        self._signals: dict[str, asyncio.Event] = {}
        self.closing = asyncio.Event()

    def signal(self, task_id: str) -> asyncio.Event:
        if task_id not in self._signals:
            self._signals[task_id] = asyncio.Event()
        return self._signals[task_id]

    def notify(self, task_id: str) -> None:
        if (sig := self._signals.pop(task_id, None)) is not None:
            sig.set()

    def close(self) -> None:
        self.closing.set()
        for sig in self._signals.values():
            sig.set()
        self._signals.clear()
