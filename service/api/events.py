"""``GET /lmsp/v1/tasks/{id}/events``: the task's event log as SSE, replayed then live (LMSP 6.4)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from service.api.state import AppState
from service.errors import InvalidRequestError, LmspdError
from service.responses.schema import FINAL_EVENTS
from service.store.tasks import Event

TERMINAL = {"succeeded", "failed", "cancelled"}


class EventHistoryExpiredError(LmspdError):
    code = "event_history_expired"


def _resume_point(request: Request, next_seq: int) -> int:
    raw = request.headers.get("last-event-id")
    param = "Last-Event-ID"
    if raw is None:
        raw, param = request.query_params.get("after"), "after"
    if raw is None:
        return -1
    try:
        after = int(raw)
    except ValueError:
        raise InvalidRequestError(f"{param} must be an integer, got {raw!r}", param=param) from None
    if not -1 <= after < next_seq:
        raise InvalidRequestError(
            f"{param} {after} is not a sequence number of this task (last is {next_seq - 1})", param=param
        )
    return after


async def task_events(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    task_id = request.path_params["task_id"]
    task = await app.store.get(task_id, app.auth.owner(request))
    after = _resume_point(request, task.next_seq)
    if task.events_expired:
        raise EventHistoryExpiredError(f"the events of task {task_id} are past their retention window")
    return StreamingResponse(
        _stream(app, task_id, after),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


Frame = Callable[[Event], bytes]


def lmsp_frame(ev: Event) -> bytes:
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (ev.seq, ev.type.encode(), ev.data)


async def event_frames(app: AppState, task_id: str, after: int, frame: Frame) -> AsyncIterator[bytes]:
    """A task's events after ``after``, replayed then live, up to and including its final
    event; keep-alive comments while it waits. Ends early when the server shuts down."""
    keepalive = app.config.server.keepalive_secs
    while True:
        signal = app.hub.signal(task_id)  # taken before reading, so no commit slips between
        events = await app.store.events_after(task_id, after, 1000)
        if events:
            # One write per batch: a replay is bounded by the database read, not by per-event sends.
            final = next((i for i, ev in enumerate(events) if ev.type in FINAL_EVENTS), None)
            batch = events if final is None else events[: final + 1]
            yield b"".join(frame(ev) for ev in batch)
            if final is not None:
                return
            after = batch[-1].seq
            continue
        if app.hub.closing.is_set():
            return
        if (await app.store.get(task_id)).status in TERMINAL and not await app.store.events_after(task_id, after, 1):
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(signal.wait(), keepalive)
            continue
        yield b": keep-alive\n\n"


async def _stream(app: AppState, task_id: str, after: int) -> AsyncIterator[bytes]:
    yield b"retry: 2000\n\n"
    async for chunk in event_frames(app, task_id, after, lmsp_frame):
        yield chunk
