"""A task's claim by the run that serves it, and what that run carries from step to step.

A task on a model already in memory is claimed (``loading`` → ``running``) in one commit written
while its prompt is prepared: the claim is *ahead* of the work, and whatever the run writes
into the task waits for it to land (:meth:`Claim.held`). Any other task is claimed once its
model is loaded, and is the run's from then on. Either way the answer lives here, not in each
step that must ask it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from lmspd.responses.builder import ResponseState
from lmspd.responses.schema import TaskRequest
from lmspd.store.task_store import TaskRecord


class Claim:
    """``commit``: the claim's commit, still being written (None: claimed after loading)."""

    def __init__(self, commit: asyncio.Future[bool] | None = None) -> None:
        self._commit = commit

    @property
    def ahead(self) -> bool:
        """Claimed before its model was resolved (a resident model: slots taken, no load)."""
        return self._commit is not None

    async def held(self) -> bool:
        """The task is this run's: its claim committed (claimed after loading: it is)."""
        return self._commit is None or await self._commit

    async def settled(self) -> None:
        """Wait for the commit to land, whatever its outcome: nothing else may touch the task first."""
        if self._commit is not None:
            with contextlib.suppress(Exception):
                await self._commit


@dataclass
class Run:
    """One claimed task on its way through the engine: what each step of the supervisor's
    ``_serve`` reads. ``request`` is the stored one until the reasoning echo puts back what the
    client dropped; ``echoed`` are the echo's keys used, marked used when the task succeeds."""

    task: TaskRecord
    state: ResponseState
    request: TaskRequest
    name: str  # the model as named at intake
    claim: Claim
    echoed: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.task.id
