"""How a task ends from the client's side: cancelled (docs/lmsp.md §7.3), waited for by a
synchronous request, abandoned by a client that went away, released once read, deleted.

The chores a foreground request leaves (settling an abandoned task, or one the full storage kept
from ending) run detached, as the request's own scope is gone by then; :meth:`Endings.close`
ends them with the service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec

from lmspd.config import Config
from lmspd.core.hub import Hub
from lmspd.core.reads import Reads
from lmspd.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    LmspdError,
    StorageFullError,
    TaskNotCancelableError,
)
from lmspd.responses.builder import ResponseState
from lmspd.store.status import ACTIVE, TERMINAL
from lmspd.store.task_store import TaskRecord, TaskStore

log = logging.getLogger("lmspd.core")
# A cancel the full storage refused is tried again after this, doubling up to the last.
FIRST_RETRY_SECS, LAST_RETRY_SECS = 0.5, 8.0


class Endings:
    """``stop``: stops a started task's generation (the supervisor's ``cancel``)."""

    def __init__(
        self, config: Config, store: TaskStore, hub: Hub, reads: Reads, stop: Callable[[str], Awaitable[None]]
    ) -> None:
        self.config = config
        self.store = store
        self.hub = hub
        self.reads = reads
        self.stop = stop
        self._limits_enforced_at = 0.0
        self._chores: set[asyncio.Task[None]] = set()  # abandoned requests still settling

    async def close(self) -> None:
        for chore in list(self._chores):
            chore.cancel()
        await asyncio.gather(*self._chores, return_exceptions=True)

    # --- cancel ---------------------------------------------------------------------------------

    async def cancel(self, task_id: str, owner: str | None) -> TaskRecord:
        """docs/lmsp.md §7.3. A queued task is cancelled at once with its final events; a started one
        goes to ``cancelling`` and the supervisor settles it at the next decode step."""
        task = await self.store.get(task_id, owner)
        if task.status in TERMINAL or task.status == "cancelling":
            # Decided without the event log: a finished task's log may have been purged.
            if task.status in ("succeeded", "failed"):
                raise TaskNotCancelableError(f"task {task_id} already {task.status}")
            return task
        # The whole log: a task requeued by ``resume`` already streamed deltas.
        state = ResponseState.from_events(await self.store.all_events(task_id))
        final = state.cancelled()
        task = await self.store.cancel(task_id, owner, final_events=final, response=state.encoded())
        self.hub.notify(task_id)
        if task.status == "cancelling":
            await self.stop(task_id)
        return task

    async def cancel_and_wait(self, task_id: str, owner: str | None, timeout: float = 10.0) -> TaskRecord:
        """Cancel, then wait (bounded) for the engine to stop, so the caller sees the end."""
        task = await self.cancel(task_id, owner)
        if task.status in ACTIVE:
            with contextlib.suppress(TimeoutError):
                task = await asyncio.wait_for(self.reads.wait(task_id), timeout)
        return task

    # --- a foreground request's end -------------------------------------------------------------

    async def outcome(self, task: TaskRecord) -> TaskRecord:
        """A synchronous request's wait: until its task is finished. With the storage full
        the task cannot go on, nor its end be written: StorageFullError (503) then, at once,
        rather than a wait for room that may never come; the task ends by its policy once
        there is room (``fail``: ``storage_full``), and is released then."""
        while True:
            signal = self.hub.signal(task.id)
            current = await self.store.get(task.id)
            if current.status in TERMINAL:
                return current
            if self.reads.stalled(task.id):
                self.settle_later(current)
                raise StorageFullError(
                    f"the server's storage is full: response {task.response_id} cannot be completed now; "
                    "it ends by its policy once there is room (retry later)"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signal.wait(), 5.0)

    async def past_compaction(self, task: TaskRecord) -> None:
        """A foreground request with ``context_management``: wait until its task is past
        compaction, so a refusal is an HTTP error (seed: compaction ends before the stream
        opens). A refused task is deleted: the client never learns its id."""
        async for batch in self.reads.follow(task.id, -1):
            for ev in batch:
                if ev.type in ("response.created", "response.queued", "response.in_progress", "mlx.compaction.started"):
                    continue
                if ev.type == "response.failed":
                    final = await self.store.get(task.id)
                    problem = msgspec.json.decode(final.error) if final.error else {}
                    if problem.get("code") == "invalid_prompt":
                        await self.store.delete(task.id)
                        raise ContextLengthExceededError(str(problem.get("detail")), param="input")
                return

    def settle_later(self, task: TaskRecord) -> None:
        """A foreground request answered before its task could end (the storage is full):
        once it has ended, release it. One that never started is cancelled (its client was
        told to retry, so it must not run); a started one ends by its policy."""
        self._chore(self._settle_later(task), f"settle {task.id}")

    async def _settle_later(self, task: TaskRecord) -> None:
        try:
            if task.status == "queued":
                await self._cancel_when_there_is_room(task.id)
            await self.release(await self.reads.wait(task.id))
        except LmspdError as exc:  # gone already (deleted, purged): nothing left to settle
            log.info("task %s: %s", task.id, exc.message)

    def abandon(self, task: TaskRecord) -> None:
        """The client of a foreground request went away: cancel it, and forget it once it
        ends if it was not to be stored. Runs detached: the request's own scope is cancelled.
        A stream that ends because the server is shutting down was not abandoned by its
        client: the task stays as it is, for its on_restart policy after the restart."""
        if self.hub.closing.is_set():
            return
        self._chore(self._abandon(task), f"abandon {task.id}")

    def _chore(self, work: Coroutine[Any, Any, None], name: str) -> None:
        chore = asyncio.create_task(work, name=name)
        self._chores.add(chore)
        chore.add_done_callback(self._chores.discard)

    async def _abandon(self, task: TaskRecord) -> None:
        try:
            await self._cancel_when_there_is_room(task.id)
            await self.release(await self.reads.wait(task.id))
        except LmspdError as exc:  # gone already (deleted, purged): nothing left to settle
            log.info("abandoned task %s: %s", task.id, exc.message)

    async def _cancel_when_there_is_room(self, task_id: str) -> None:
        """Cancel; with the storage full, again after a while, until it is written."""
        wait = FIRST_RETRY_SECS
        while True:
            try:
                await self.cancel(task_id, None)
                return
            except TaskNotCancelableError:
                return
            except StorageFullError:
                await asyncio.sleep(wait)
                wait = min(2 * wait, LAST_RETRY_SECS)

    async def release(self, task: TaskRecord) -> None:
        """A foreground request has read its finished response: drop it if not stored, and
        keep the store within its caps."""
        if not task.stored and not task.background:
            await self.store.delete(task.id)
        now = time.monotonic()
        if now - self._limits_enforced_at >= 1.0:  # cheap queries, but not on every request
            self._limits_enforced_at = now
            await self.store.enforce_response_limits(self.config.responses)

    async def delete(self, task: TaskRecord) -> None:
        if task.status not in TERMINAL:
            raise InvalidRequestError(
                f"response '{task.response_id}' has not finished: cancel it first", param="response_id"
            )
        await self.store.delete(task.id)
