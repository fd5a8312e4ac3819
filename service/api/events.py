"""Server-sent events: a task's event log as SSE, in LMSP's framing (docs/lmsp.md §6.4) or OpenAI's.

Every stream is an :class:`EventStream`: events are read from the database only as fast as
the reader takes them (each write, of at most ``SSE_CHUNK_BYTES``, waits for the socket), so
a slow reader holds at most one database batch (``SSE_BATCH`` events) while it is served and one
write after. A
reader that takes nothing for two keep-alive intervals is disconnected (the stream ends
without its terminating chunk); it resumes with ``Last-Event-ID`` (``starting_after`` on
/v1) from the last event it received.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import NamedTuple, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from lmspd.api.state import state_of
from lmspd.api.wire import ascii_int
from lmspd.core import Core
from lmspd.errors import EventHistoryExpiredError
from lmspd.responses.schema import FINAL_EVENTS
from lmspd.store.status import TERMINAL
from lmspd.store.task_store import Event, TaskRecord

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_CHUNK_BYTES = 64 * 1024
SSE_BATCH = 256  # events read from the database at once for a stream: what a slow reader can hold
log = logging.getLogger("lmspd.sse")


class EventStream(StreamingResponse):
    """An SSE response whose reader must keep up: a write the reader has not taken within
    ``stall_secs`` ends the stream (and ``stream``, so an owning /v1 stream abandons its task)."""

    def __init__(self, stream: AsyncGenerator[bytes, None], stall_secs: float) -> None:
        super().__init__(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        self._stream = stream
        self.stall_secs = stall_secs

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self._stream:
                for start in range(0, len(chunk), SSE_CHUNK_BYTES):
                    piece = chunk[start : start + SSE_CHUNK_BYTES]
                    try:
                        await asyncio.wait_for(
                            send({"type": "http.response.body", "body": piece, "more_body": True}), self.stall_secs
                        )
                    except TimeoutError:
                        log.info("event stream reader took nothing for %.0f s: disconnected", self.stall_secs)
                        return  # no terminating chunk: the reader sees a cut stream and resumes
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._stream.aclose()


def event_stream(request: Request, stream: AsyncGenerator[bytes, None]) -> EventStream:
    """``stream`` as SSE; its reader is gone once it has taken nothing for two keep-alive intervals."""
    return EventStream(stream, 2 * state_of(request).config.server.keepalive_secs)


def resume_point(raw: str | None, param: str, next_seq: int) -> int:
    """A client's resume point: -1 for the start, else a sequence number the task has."""
    return -1 if raw is None else ascii_int(raw, param, -1, next_seq - 1)


async def task_events(request: Request) -> Response:
    app = state_of(request)
    task_id = request.path_params["task_id"]
    task = await app.core.reads.task(task_id, app.auth.owner(request))
    if (raw := request.headers.get("last-event-id")) is not None:
        after = resume_point(raw, "Last-Event-ID", task.next_seq)
    else:
        after = resume_point(request.query_params.get("after"), "after", task.next_seq)
    if task.events_expired:
        raise EventHistoryExpiredError(f"the events of task {task_id} are past their retention window")
    return event_stream(request, _lmsp_stream(app.core, task_id, after))


def lmsp_frame(ev: Event) -> bytes:
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (ev.seq, ev.type.encode(), ev.data)


async def _lmsp_stream(core: Core, task_id: str, after: int) -> AsyncGenerator[bytes, None]:
    # One write per batch of events: a replay is bounded by the database read, not by sends.
    with core.metrics.sse_streams.labels("lmsp").track_inprogress():
        yield b"retry: 2000\n\n"
        async for batch in core.reads.follow(task_id, after, SSE_BATCH):
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


CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that hung up: only the access log sees it


class ClientGone(Exception):
    """The client hung up before its answer; the app answers :data:`CLIENT_CLOSED_REQUEST`."""


async def while_connected(request: Request, work: Awaitable[T], *, task: TaskRecord | None = None) -> T:
    """``work``'s result while the client is still there. If it hangs up first, ``work`` is
    cancelled, the foreground ``task`` it waited on (if any) is abandoned (docs/responses.md:
    a sync request's task is cancelled, and forgotten when not stored) and :class:`ClientGone`
    is raised. The one disconnect path of every request that waits before it answers."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
    if job.done() and not job.cancelled():
        return job.result()
    if task is not None:
        state_of(request).core.endings.abandon(task)
    raise ClientGone


async def client_gone(request: Request, exc: Exception) -> Response:
    """The app's handler for :class:`ClientGone`."""
    return Response(status_code=CLIENT_CLOSED_REQUEST)


Render = Callable[[list[Event]], bytes]


class Cut(NamedTuple):
    """Why the server ends a /v1 stream before its response has ended: said to the client as
    the stream's last event (an ``error`` event, or Chat's error frame), then ``[DONE]``."""

    code: str  # server_shutting_down | storage_full
    message: str  # what happens to the response, and how to get it
    sequence_number: int  # of the last event the client got: a resume starts after it


def _cut(core: Core, task: TaskRecord, last: int) -> Cut:
    """The shutdown's or the full storage's end of a stream at event ``last``."""
    rid = task.response_id
    if core.reads.stalled(task.id):
        return Cut(
            "storage_full",
            f"the server's storage is full: response {rid} cannot go on now; it ends by its policy once "
            "there is room (retry later)",
            last,
        )
    if task.stored or task.background:
        resume = f"GET /v1/responses/{rid} (with ?stream=true&starting_after={last} to follow it from here)"
        then = f"The response {rid} is kept: once the server is back, {resume}."
    else:
        then = "The response was not stored (store: false): send the request again once the server is back."
    return Cut(
        "server_shutting_down", f"the server is shutting down: this stream ends before its response. {then}", last
    )


async def openai_stream(
    core: Core,
    task: TaskRecord,
    after: int,
    render: Render,
    end: Callable[[Cut], bytes],
    *,
    own: bool,
    idle: bytes = b": keep-alive\n\n",
    trailer: bytes = b"data: [DONE]\n\n",
    keepalive: float | None = None,
) -> AsyncGenerator[bytes, None]:
    """A /v1 stream (Responses, Chat Completions or Messages): the rendered events, then
    ``trailer`` (``data: [DONE]``; Messages streams end with their last event). While nothing
    happens for ``keepalive`` seconds (the server's keep-alive interval by default), ``idle``
    is sent: a comment, or Messages' ``ping`` event.

    A stream the server ends before its response (a shutdown, or a storage too full to go
    on) says why as its last event (``end``), then ``[DONE]``, so a client never reads a
    silent cut; the task stays as it is (settled by its policy). A stream that owns its
    foreground task abandons it when the client goes away (the server cancels this
    generator's scope: the abandoning runs detached); a replay of a background response
    never cancels it."""
    finished = cut = False
    last = after
    core.metrics.sse_streams.labels("openai").inc()
    try:
        async with contextlib.aclosing(core.reads.follow(task.id, after, SSE_BATCH, keepalive)) as batches:
            async for batch in batches:
                if batch:
                    last = batch[-1].seq
                    finished = batch[-1].type in FINAL_EVENTS
                    yield render(batch)
                    if own:
                        delivered(core, task.id, batch)
                elif core.reads.stalled(task.id):
                    break  # nothing comes until there is room
                else:
                    yield idle
        if not finished and (await core.reads.task(task.id, None)).status in TERMINAL:
            # It ended as the stream did (or before the point it resumed from): whatever
            # is left of its log is there to send, up to its final event.
            async for batch in core.reads.follow(task.id, last, SSE_BATCH):
                if batch:
                    last = batch[-1].seq
                    yield render(batch)
            finished = True
        if not finished:
            cut = True
            yield end(_cut(core, task, last))
        yield trailer
        if own and finished:
            await core.endings.release(await core.reads.task(task.id, None))
    finally:
        core.metrics.sse_streams.labels("openai").dec()
        if own and not finished:
            if cut and core.reads.stalled(task.id):
                core.endings.settle_later(task)  # it fails by its policy once there is room; then released
            else:
                core.endings.abandon(task)  # (not while shutting down: then the task is left to its policy)
