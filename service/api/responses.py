"""OpenAI Responses API (``/v1/responses``, ``/responses``, ``POST /lmsp/v1/responses``).

Every response runs as a durable task of kind ``response``: synchronous and
streaming requests wait on, or stream, the same event log a background request
leaves behind to be polled, so stored responses survive restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from service.api.events import event_frames
from service.api.state import AppState
from service.api.wire import decode, fingerprint, idempotency_key, read_body
from service.errors import InvalidRequestError, LmspdError
from service.generation import check_request, tokenizer_for
from service.responses import schema as s
from service.responses.builder import ResponseState, initial_response
from service.responses.history import FINISHED
from service.responses.history import history as history_for
from service.store.tasks import Event, NewEvent, ResponseFields, TaskRecord


class ResponseNotFoundError(LmspdError):
    code = "not_found"


class TooManyBackgroundJobsError(LmspdError):
    code = "rate_limit_exceeded"


def _store_enabled(app: AppState) -> bool:
    return app.config.responses.store_max_entries > 0


def _require_store(app: AppState, param: str) -> None:
    if not _store_enabled(app):
        raise InvalidRequestError("the response store is disabled (store_max_entries = 0)", param=param)


async def _admit(app: AppState, req: s.ResponseRequest) -> None:
    """The seed's limits on what may be created."""
    limits = app.config.responses
    if req.previous_response_id is not None:
        _require_store(app, "previous_response_id")
    if req.conversation is not None and limits.conversation_store_max_entries == 0:
        raise InvalidRequestError(
            "conversations are disabled (conversation_store_max_entries = 0)", param="conversation"
        )
    if req.background:
        if 0 in (limits.background_max_jobs, limits.store_max_entries, limits.store_max_bytes):
            raise InvalidRequestError("background mode is disabled by the response store settings", param="background")
        if await app.store.active_background() >= limits.background_max_jobs:
            raise TooManyBackgroundJobsError(f"{limits.background_max_jobs} background responses are already active")


def _keeps(app: AppState, req: s.ResponseRequest) -> bool:
    """Whether a finished response stays readable (store on, and a byte budget to hold it)."""
    return req.store and _store_enabled(app) and app.config.responses.store_max_bytes > 0


async def _enforce_limits(app: AppState) -> None:
    """Evict past the store caps, at most once a second (cheap queries, run off the request)."""
    now = time.monotonic()
    if now - app.limits_enforced_at >= 1.0:
        app.limits_enforced_at = now
        await app.store.enforce_response_limits(app.config.responses)


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _raw_json(data: bytes, status: int = 200) -> Response:
    return Response(data, status_code=status, media_type="application/json")


async def _snapshot(app: AppState, task: TaskRecord) -> bytes:
    """The response object as it stands: final once finished, else the latest snapshot."""
    if task.response is not None:
        return task.response
    events, after = [], -1
    while batch := await app.store.events_after(task.id, after, 5000):
        events += batch
        after = batch[-1].seq
    return s.encoder.encode(ResponseState.from_events(events).response)


def _check(app: AppState, req: s.ResponseRequest, history: list[dict[str, Any]]) -> int | None:
    model = app.registry.resolve_local(req.model or app.config.default_model)
    sampling = app.sampling(req)
    if model is None:
        sampling.validate()
        return None
    return check_request(model, req.messages(history), sampling, req.chat_template_kwargs)


async def _lookup(app: AppState, request: Request) -> TaskRecord:
    _require_store(app, "response_id")
    response_id = request.path_params["response_id"]
    task = await app.store.get_by_response(response_id, app.auth.owner(request))
    if task is None or task.kind != "response" or (not task.stored and not task.background):
        raise ResponseNotFoundError(f"response '{response_id}' not found", param="response_id")
    return task


async def create_response(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    owner = app.auth.owner(request)
    app.check_accepting()
    body = await read_body(request, app.config.server.max_body_bytes)
    req = decode(body, s.ResponseRequest)
    req.validate()
    await _admit(app, req)
    key = idempotency_key(request) if req.background else None
    history = await history_for(app.store, owner, req.previous_response_id, req.conversation_id)
    await asyncio.to_thread(_check, app, req, history)
    model_name = req.model or app.config.default_model

    def first_event(task: TaskRecord, seq: int) -> NewEvent:
        resp = initial_response(
            req, response_id=task.response_id, model=model_name, created_at=task.created_at, background=req.background
        )
        return ResponseState(resp).created()[0](task, seq)

    task, _ = await app.store.create(
        owner=owner,
        request=msgspec.json.encode(req),
        on_restart="fail",
        first_event=first_event,
        idempotency=(key, fingerprint(body)) if key else None,
        response=ResponseFields(
            background=req.background,
            stored=_keeps(app, req),
            previous_response_id=req.previous_response_id,
            conversation=req.conversation_id,
        ),
    )
    app.supervisor.wake()
    if req.background:
        if not req.store:
            await app.store.set_expiry(task.id, int(time.time()) + app.config.responses.background_ephemeral_ttl_secs)
        return _raw_json(await _snapshot(app, task))
    if req.stream:
        return StreamingResponse(
            _stream_and_settle(app, request, task, -1, own=True),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    final = await _wait(app, request, task.id)
    data = await _snapshot(app, final)
    if not final.stored:
        await app.store.delete(task.id)
    await _enforce_limits(app)
    return _raw_json(data)


async def _wait(app: AppState, request: Request, task_id: str) -> TaskRecord:
    """Wait for the task to finish; a client that hangs up cancels it."""
    while True:
        signal = app.hub.signal(task_id)
        task = await app.store.get(task_id)
        if task.status in FINISHED:
            return task
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(signal.wait(), 0.5)
        if await request.is_disconnected():
            await _cancel(app, task_id)


async def _cancel(app: AppState, task_id: str) -> TaskRecord:
    events = await app.store.events_after(task_id, -1, 2)
    task = await app.store.cancel(task_id, None, final_event=ResponseState.from_events(events).cancelled()[0])
    app.hub.notify(task_id)
    if task.status == "cancelling":
        await app.supervisor.cancel(task_id)
    return task


def _openai_frame(ev: Event) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (ev.type.encode(), ev.data)


async def _stream_and_settle(
    app: AppState, request: Request, task: TaskRecord, after: int, own: bool
) -> AsyncIterator[bytes]:
    """SSE in OpenAI's shape (``event:`` = type, then ``data: [DONE]``). A stream that owns its
    response cancels it when the client goes away, and forgets it after if store is false."""
    finished = False
    try:
        async for chunk in event_frames(app, task.id, after, _openai_frame):
            yield chunk
        finished = (await app.store.get(task.id)).status in FINISHED
        if finished:
            yield b"data: [DONE]\n\n"
    finally:
        if own and not finished:
            with contextlib.suppress(LmspdError):
                await _cancel(app, task.id)
        if own and finished:
            if not task.stored:
                await app.store.delete(task.id)
            await _enforce_limits(app)


async def get_response(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    task = await _lookup(app, request)
    if request.query_params.get("stream") in ("true", "1"):
        raw = request.query_params.get("starting_after", "-1")
        try:
            after = int(raw)
        except ValueError:
            raise InvalidRequestError("starting_after must be an integer", param="starting_after") from None
        if not -1 <= after < task.next_seq:
            raise InvalidRequestError(f"starting_after {after} is past the last event", param="starting_after")
        return StreamingResponse(
            _stream_and_settle(app, request, task, after, own=False),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return _raw_json(await _snapshot(app, task))


async def delete_response(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    task = await _lookup(app, request)
    if task.status not in FINISHED:
        raise InvalidRequestError(
            f"response '{task.response_id}' has not finished: cancel it first", param="response_id"
        )
    await app.store.delete(task.id)
    return _json({"id": task.response_id, "object": "response", "deleted": True})


async def cancel_response(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    task = await _lookup(app, request)
    if task.status not in FINISHED:
        await _cancel(app, task.id)
        deadline = time.monotonic() + 10
        while (task := await app.store.get(task.id)).status not in FINISHED and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    return _raw_json(await _snapshot(app, task))


async def input_tokens(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    owner = app.auth.owner(request)
    req = decode(await read_body(request, app.config.server.max_body_bytes), s.ResponseRequest)
    req.validate()
    history = await history_for(app.store, owner, req.previous_response_id, req.conversation_id)
    model = await asyncio.to_thread(app.registry.resolve, req.model or app.config.default_model)
    tok = tokenizer_for(model)
    count = len(tok.encode_chat(req.messages(history), **(req.chat_template_kwargs or {})))
    return _json({"object": "response.input_tokens", "input_tokens": count})


async def list_models(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    app.auth.owner(request)
    data = [{"id": m.name, "object": "model", "created": 0, "owned_by": "lmspd"} for m in app.registry.list()]
    return _json({"object": "list", "data": data})
