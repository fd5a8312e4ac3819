"""A task's writes and how it ends: its events committed, its transitions, its terminal
states, and the settling, by ``on_restart`` policy, of the tasks a restart, a crash or a full
disk interrupted (docs/lmsp.md §7.5). The supervisor runs tasks and calls these; so does the
cluster's takeover (``recover``). Each write notifies the task's readers after it commits."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from lmspd.core.hub import Hub
from lmspd.core.storage_backoff import StorageBackoff
from lmspd.errors import StorageFullError, error_for
from lmspd.responses import schema as s
from lmspd.responses.builder import ResponseState
from lmspd.store.conn import Job
from lmspd.store.status import TERMINAL, TaskStatus
from lmspd.store.task_store import EventBuilder, TaskRecord, TaskStore

log = logging.getLogger("lmspd.supervisor")


class Transitions:
    """``running``: whether a task's run is still under way here (it settles itself then)."""

    def __init__(self, store: TaskStore, hub: Hub, storage: StorageBackoff, running: Callable[[str], bool]) -> None:
        self.store = store
        self.hub = hub
        self.storage = storage
        self.running = running

    # --- recovery (docs/lmsp.md §7.5) ---------------------------------------------------------

    async def recover(self, task_ids: list[str] | None = None) -> None:
        """Settle every unfinished task by its policy before new work is accepted (``task_ids``:
        those taken over from a dead node). A task whose record cannot be read fails alone; with
        the storage full, the rest wait. On PostgreSQL a node settles only what it holds."""
        for task_id in await self.store.unfinished_ids() if task_ids is None else task_ids:
            try:
                await self._recover_one(task_id)
            except StorageFullError:
                self.storage.full(task_id)
            except Exception as exc:
                log.error("task %s could not be recovered (%s: %s)", task_id, type(exc).__name__, exc)
            self.hub.notify(task_id)

    async def _recover_one(self, task_id: str) -> None:
        task = await self.store.get(task_id)
        if task.status == "queued":
            return  # never started: nothing was lost, it runs in turn
        state = await self.state(task)
        if state is None:
            return
        if task.status == "cancelling":
            await self.cancelled(task_id, state)
        else:
            await self.interrupted(task, state, "server_restarted", "the server restarted during generation")

    async def state(self, task: TaskRecord) -> ResponseState | None:
        """The task's response as its event log left it; None if the log cannot be read, and
        then the task has failed with ``task_corrupt`` (one damaged row stops only its task)."""
        try:
            return ResponseState.from_events(await self.store.all_events(task.id))
        except StorageFullError:
            raise
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
        log.error("task %s failed: its event log cannot be read back (%s)", task.id, cause)
        blank = s.Response(id=task.response_id, created_at=task.created_at, status="in_progress", model="")
        state = ResponseState(blank)
        await self.fail(task.id, state, "task_corrupt", f"the task's stored events cannot be read back ({cause})")
        return None

    # --- storage full ---------------------------------------------------------------------------

    async def settle_stalled(self) -> bool:
        """Wait out the backoff, then settle the tasks the full storage stopped by their
        policy. False: still full (nothing is claimed this round)."""
        if self.storage.wait is not None:
            await asyncio.sleep(self.storage.wait)
            self.storage.longer()
        wrote = False
        try:
            for task_id in sorted(self.storage.stalled):
                if self.running(task_id):
                    continue  # still winding down: settled on a later round
                task = await self.store.get(task_id)
                if task.status not in TERMINAL and task.status != "queued":
                    if (state := await self.state(task)) is not None:
                        if task.status == "cancelling":
                            await self.cancelled(task_id, state)
                        else:
                            detail = "the server's storage was full during generation"
                            await self.interrupted(task, state, "storage_full", detail)
                    wrote = True
                self.storage.stalled.discard(task_id)
                self.hub.notify(task_id)
        except StorageFullError:
            self.storage.full()
            return False
        if wrote:
            self.storage.ok()
        return True  # a claim that fails for want of room backs off again

    async def interrupted(self, task: TaskRecord, state: ResponseState, code: str, detail: str) -> None:
        """A generation cut short (``code``: why): the task retried, resumed or failed as its
        ``on_restart`` says."""
        if task.on_restart == "retry":
            await self.store.requeue(task.id, new_attempt=True, events=state.restarted(task.attempt + 1, code))
        elif task.on_restart == "resume":
            await self.resume(task.id)
        else:
            await self.fail(task.id, state, code, detail)

    # --- the writes ------------------------------------------------------------------------------

    async def commit(self, task_id: str, events: list[EventBuilder]) -> None:
        """Events appended, committed before any reader is woken."""
        await self.store.append_events(task_id, events)
        self.hub.notify(task_id)
        self.storage.ok()

    async def to(
        self, task_id: str, status: TaskStatus, events: list[EventBuilder], via: TaskStatus | None = None
    ) -> bool:
        """A transition that is not an ending (``loading``, ``running``); False: the task was
        not where ``via`` (or its current status) said, it was cancelled or taken first."""
        done = await self.store.transition(task_id, status, events=events, via=via)
        self.hub.notify(task_id)
        self.storage.ok()
        return done is not None

    async def cancelled(self, task_id: str, state: ResponseState) -> None:
        """The cancel settled: ``cancelled``, with the response as far as it got."""
        events = state.cancelled()
        await self.final(task_id, "cancelled", events, state)

    async def final(
        self,
        task_id: str,
        status: TaskStatus,
        events: list[EventBuilder],
        state: ResponseState,
        error: bytes | None = None,
        also: Job | None = None,
    ) -> bool:
        """A terminal transition; it keeps the final response object with the task, as the
        event log is purged after the retention window while the response stays readable.
        ``also`` is written in the same transaction (the reasoning echo's rows)."""
        done = await self.store.transition(
            task_id, status, events=events, response=state.encoded(), error=error, also=also
        )
        self.hub.notify(task_id)
        return done is not None

    async def fail(self, task_id: str, state: ResponseState, code: str, detail: str) -> None:
        error = msgspec.json.encode(error_for(code, detail).problem())
        if not await self.final(task_id, "failed", state.failed(code, detail), state, error):
            await self.cancelled(task_id, state)  # it was cancelling: cancel wins

    async def resume(self, task_id: str) -> None:
        """Back to the queue in the same attempt: it continues from its committed tokens."""
        await self.store.requeue(task_id, new_attempt=False)
