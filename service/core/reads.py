"""Reading tasks, their responses and their event logs, and waiting on them: what every surface's
GET routes and event streams call. Nothing here writes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from lmspd.config import Config, ResponsesConfig
from lmspd.core.hub import Hub
from lmspd.core.storage_backoff import StorageBackoff
from lmspd.errors import InvalidRequestError, NotFoundError
from lmspd.responses import schema as s
from lmspd.responses.builder import ResponseState
from lmspd.store.status import TERMINAL
from lmspd.store.task_store import Event, TaskRecord, TaskStore


def store_enabled(limits: ResponsesConfig) -> bool:
    return limits.store_max_entries > 0


def require_store(limits: ResponsesConfig, param: str) -> None:
    if not store_enabled(limits):
        raise InvalidRequestError("the response store is disabled (store_max_entries = 0)", param=param)


class Reads:
    """``storage``: the supervisor's, which knows the tasks the full storage stalled."""

    def __init__(self, config: Config, store: TaskStore, hub: Hub, storage: StorageBackoff) -> None:
        self.config = config
        self.store = store
        self.hub = hub
        self.storage = storage

    async def task(self, task_id: str, owner: str | None) -> TaskRecord:
        return await self.store.get(task_id, owner)

    async def tasks(
        self, owner: str, *, limit: int, after: str | None, statuses: list[str] | None
    ) -> tuple[list[TaskRecord], bool]:
        """A page of the owner's tasks, newest first, and whether more follow."""
        found = await self.store.list(owner, limit=limit + 1, after=after, statuses=statuses)
        return found[:limit], len(found) > limit

    async def response_task(self, response_id: str, owner: str) -> TaskRecord:
        """The task behind a response id, as /v1/responses/{id} sees it: a stored response
        or background job (a task's response included); foreground store:false ones are gone."""
        require_store(self.config.responses, "response_id")
        task = await self.store.get_by_response(response_id, owner)
        if task is None or (not task.stored and not task.background):
            raise NotFoundError(f"response '{response_id}' not found", param="response_id")
        return task

    async def snapshot(self, task: TaskRecord) -> bytes:
        """The response object as it stands: the final one once finished (kept with the task
        for every terminal state, as its events may be purged), else rebuilt from the log."""
        if task.response is not None:
            return task.response
        events = await self.store.all_events(task.id)
        if not events:  # a finished task whose log was purged (only rows older than this rule)
            raise NotFoundError(f"response '{task.response_id}' is no longer available", param="response_id")
        return ResponseState.from_events(events).encoded()

    async def input_items(self, task: TaskRecord) -> list[Any]:
        """The request's own input items, in order (not the history it continued)."""
        request = msgspec.json.decode(task.request, type=s.TaskRequest)
        return request.items()

    async def follow(
        self, task_id: str, after: int, batch_size: int = 1000, keepalive: float | None = None
    ) -> AsyncGenerator[list[Event], None]:
        """A task's events after ``after`` in batches of at most ``batch_size``, replayed then
        live, up to and including its final event. An empty batch means nothing happened for
        ``keepalive`` seconds (default ``keepalive_secs``). Ends early when the server shuts down."""
        keepalive = self.config.server.keepalive_secs if keepalive is None else keepalive
        while True:
            signal = self.hub.signal(task_id)  # taken before reading, so no commit slips between
            events = await self.store.events_after(task_id, after, batch_size)
            if events:
                final = next((i for i, ev in enumerate(events) if ev.type in s.FINAL_EVENTS), None)
                batch = events if final is None else events[: final + 1]
                yield batch
                if final is not None:
                    return
                after = batch[-1].seq
                continue
            if self.hub.closing.is_set():
                return
            if (await self.store.get(task_id)).status in TERMINAL:
                if not await self.store.events_after(task_id, after, 1):
                    return
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signal.wait(), keepalive)
                continue
            yield []

    async def wait(self, task_id: str) -> TaskRecord:
        """Until the task is finished."""
        while True:
            signal = self.hub.signal(task_id)
            task = await self.store.get(task_id)
            if task.status in TERMINAL:
                return task
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signal.wait(), 5.0)

    def stalled(self, task_id: str) -> bool:
        """A write of the task's failed for want of room: nothing more of it (not even its
        end) is written until there is room again."""
        return task_id in self.storage.stalled
