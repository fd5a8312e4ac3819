"""The supervisor's state while the database is full: which tasks a failed write stopped,
how long to wait before the next try, and the one log line that says so.

A full disk fails every write until someone frees space: retrying at once would claim and
fail the same tasks in a loop (and log a traceback each time). Instead the stopped tasks
wait, the supervisor backs off (doubling up to a bound), and the first write that succeeds
ends it. The stopped tasks are then settled by their ``on_restart`` policy.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("lmspd.supervisor")

FIRST_SECS, LAST_SECS = 0.5, 8.0
SAY_AGAIN_SECS = 300.0  # a disk that fills again much later is worth a new line


class StorageBackoff:
    def __init__(self, database: Path) -> None:
        self.database = database
        self.stalled: set[str] = set()  # tasks a failed write stopped, not settled yet
        self.wait: float | None = None  # the backoff; None while writes succeed
        self._said: float | None = None

    @property
    def active(self) -> bool:
        return self.wait is not None or bool(self.stalled)

    def full(self, task_id: str | None = None) -> None:
        """A write failed for want of room (``task_id``: the task it stopped)."""
        if task_id is not None:
            self.stalled.add(task_id)
        if self.wait is not None:
            return  # the wait grows per round of tries (longer), not per failed write
        self.wait = FIRST_SECS
        now = time.monotonic()
        if self._said is None or now - self._said > SAY_AGAIN_SECS:
            self._said = now
            log.warning(
                "the database %s is full: generation stops and intake answers 503 until there is room; "
                "the interrupted tasks then follow their on_restart policy",
                self.database,
            )

    def longer(self) -> None:
        """Waited once: the next wait is longer, unless a write succeeds meanwhile."""
        if self.wait is not None:
            self.wait = min(self.wait * 2, LAST_SECS)

    def ok(self) -> None:
        """A write succeeded: there is room again."""
        if self.wait is not None:
            self.wait = None
            log.warning("the database %s has room again", self.database)
