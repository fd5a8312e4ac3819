"""Server-sent events: a task's event log as SSE, in LMSP's framing (LMSP 6.4) or OpenAI's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..core import Core
from ..errors import EventHistoryExpiredError
from ..store.status import TERMINAL
from ..store.tasks import Event, TaskRecord
from .state import state_of
from .wire import ascii_int

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def resume_point(raw: str | None, param: str, next_seq: int) -> int:
    """A client's resume point: -1 for the start, else a sequence number the task has."""
    return -1 if raw is None else ascii_int(raw, param, -1, next_seq - 1)


async def task_events(request: Request) -> Response:
    app = state_of(request)
    task_id = request.path_params["task_id"]
    task = await app.core.task(task_id, app.auth.owner(request))
    if (raw := request.headers.get("last-event-id")) is not None:
        after = resume_point(raw, "Last-Event-ID", task.next_seq)
    else:
        after = resume_point(request.query_params.get("after"), "after", task.next_seq)
    if task.events_expired:
        raise EventHistoryExpiredError(f"the events of task {task_id} are past their retention window")
    return StreamingResponse(
        _lmsp_stream(app.core, task_id, after), media_type="text/event-stream", headers=SSE_HEADERS
    )


def lmsp_frame(ev: Event) -> bytes:
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (ev.seq, ev.type.encode(), ev.data)


async def _lmsp_stream(core: Core, task_id: str, after: int) -> AsyncIterator[bytes]:
    # One write per batch of events: a replay is bounded by the database read, not by sends.
    with core.metrics.sse_streams.labels("lmsp").track_inprogress():
        yield b"retry: 2000\n\n"
        async for batch in core.follow(task_id, after):
            yield b"".join(lmsp_frame(ev) for ev in batch) if batch else b": keep-alive\n\n"


def delivered(core: Core, task_id: str, batch: list[Event]) -> None:
    """The last stage of the time to first token: the batch with the first token is written
    (the stream resumes once the server has sent it). Only for the stream that submitted the
    task: any other reader may have come late."""
    if any(ev.type.endswith(".delta") for ev in batch):
        core.metrics.first_token_stages.mark(task_id, "deliver")


async def until_disconnected(request: Request) -> None:
    """Returns when the client hangs up (the ASGI server reports it at once)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None if the client went away first (``work`` is then cancelled)."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
    return job.result() if job.done() and not job.cancelled() else None


Render = Callable[[list[Event]], bytes]


async def openai_stream(core: Core, task: TaskRecord, after: int, render: Render, *, own: bool) -> AsyncIterator[bytes]:
    """A /v1 stream (Responses or Chat Completions): the rendered events, then ``data: [DONE]``.
    A stream that owns its foreground task abandons it when the client goes away (the
    server cancels this generator's scope: the abandoning runs detached); a replay of a
    background response never cancels it."""
    finished = False
    core.metrics.sse_streams.labels("openai").inc()
    try:
        async for batch in core.follow(task.id, after):
            yield render(batch) if batch else b": keep-alive\n\n"
            if own:
                delivered(core, task.id, batch)
        final = await core.task(task.id, None)
        if finished := final.status in TERMINAL:
            yield b"data: [DONE]\n\n"
            if own:
                await core.release(final)
    finally:
        core.metrics.sse_streams.labels("openai").dec()
        if own and not finished:
            core.abandon(task)
