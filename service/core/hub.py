"""Wakes event-stream readers when a task's events have been committed.

Readers take the current signal *before* reading the database and wait on it
after, so an event committed in between is never missed.
"""

from __future__ import annotations

import asyncio
import weakref


class Hub:
    def __init__(self) -> None:
        # Weak: an entry lives while a reader holds its signal, so a task nobody follows
        # (finished, or never read) leaves nothing behind however many tasks come and go.
        self._signals: weakref.WeakValueDictionary[str, asyncio.Event] = weakref.WeakValueDictionary()
        self.closing = asyncio.Event()

    def signal(self, task_id: str) -> asyncio.Event:
        sig = self._signals.get(task_id)
        if sig is None:
            sig = self._signals[task_id] = asyncio.Event()
        return sig

    def notify(self, task_id: str) -> None:
        if (sig := self._signals.pop(task_id, None)) is not None:
            sig.set()

    def notify_all(self) -> None:
        """Wake every reader (another node's changes may have been missed: read the rows)."""
        for sig in list(self._signals.values()):
            sig.set()
        self._signals.clear()

    def close(self) -> None:
        self.closing.set()
        for sig in list(self._signals.values()):
            sig.set()
        self._signals.clear()

    def __len__(self) -> int:
        """Signals readers still hold (what the hub keeps)."""
        return len(self._signals)
