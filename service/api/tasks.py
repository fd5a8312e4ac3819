"""LMSP section 7 endpoints: create, read, list, cancel tasks."""

from __future__ import annotations

import asyncio

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from service.api.state import AppState
from service.api.wire import TaskList, decode, etag, fingerprint, idempotency_key, read_body, task_object
from service.errors import InvalidRequestError
from service.generation import check_request
from service.responses.builder import ResponseState, initial_response
from service.responses.schema import TaskCreate
from service.store.tasks import TaskRecord

_INLINE_CHECK_BYTES = 16 * 1024
STATUSES = {"queued", "loading", "running", "cancelling", "succeeded", "failed", "cancelled"}


def _json(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json", headers=headers)


def _check_model(app: AppState, envelope: TaskCreate) -> None:
    """Reject what would fail anyway (unknown model, too long a prompt) before accepting.
    Runs in a worker thread: a large prompt must not stall the event loop."""
    sampling = app.sampling(envelope.input)
    model = app.registry.resolve_local(envelope.input.model or app.config.default_model)
    if model is None:  # fetched when the task runs
        sampling.validate()
    else:
        check_request(model, envelope.input.messages(), sampling)


async def create_task(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    owner = app.auth.owner(request)
    app.check_accepting()
    key = idempotency_key(request)
    body = await read_body(request, app.config.server.max_body_bytes)
    envelope = decode(body, TaskCreate)
    try:
        envelope.input.validate()
    except InvalidRequestError as exc:  # name the field as the envelope holds it
        raise InvalidRequestError(exc.message, param=f"input.{exc.param}" if exc.param else "input") from exc
    if len(body) < _INLINE_CHECK_BYTES:
        _check_model(app, envelope)  # small: cheaper than a thread hop
    else:
        await asyncio.to_thread(_check_model, app, envelope)
    model_name = envelope.input.model or app.config.default_model

    def first_event(task: TaskRecord, seq: int):  # type: ignore[no-untyped-def]
        response = initial_response(
            envelope.input, response_id=task.response_id, model=model_name, created_at=task.created_at
        )
        return ResponseState(response).created()[0](task, seq)

    task, replayed = await app.store.create(
        owner=owner,
        request=msgspec.json.encode(envelope.input),
        on_restart=envelope.on_restart,
        first_event=first_event,
        idempotency=(key, fingerprint(body)) if key else None,
    )
    app.supervisor.wake()
    headers = {"Location": f"/lmsp/v1/tasks/{task.id}"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return _json(task_object(task), 202, headers)


async def get_task(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    task = await app.store.get(request.path_params["task_id"], app.auth.owner(request))
    tag = etag(task)
    if request.headers.get("if-none-match") == tag:
        return Response(status_code=304, headers={"ETag": tag})
    return _json(task_object(task), headers={"ETag": tag})


async def list_tasks(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    owner = app.auth.owner(request)
    statuses = request.query_params.getlist("status")
    if bad := [s for s in statuses if s not in STATUSES]:
        raise InvalidRequestError(f"unknown status {bad[0]!r}", param="status")
    raw_limit = request.query_params.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise InvalidRequestError("limit must be an integer from 1 to 100", param="limit")
    limit = int(raw_limit)
    after = request.query_params.get("after")
    tasks = await app.store.list(owner, limit=limit + 1, after=after, statuses=statuses or None)
    page = tasks[:limit]
    data = [task_object(t) for t in page]
    return _json(
        TaskList(
            data=data,
            has_more=len(tasks) > limit,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
        )
    )


async def cancel_task(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    owner = app.auth.owner(request)
    task_id = request.path_params["task_id"]
    await app.store.get(task_id, owner)  # 404 before any work
    state = ResponseState.from_events(await app.store.events_after(task_id, -1, 2))
    task = await app.store.cancel(task_id, owner, final_event=state.cancelled()[0])
    app.hub.notify(task_id)
    if task.status == "cancelling":
        await app.supervisor.cancel(task_id)
    return _json(task_object(task))
