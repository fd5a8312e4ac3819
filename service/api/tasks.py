"""LMSP tasks (docs/lmsp.md §7): create, read, list, cancel tasks (translation only: see lmspd.core)."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lmspd import errors as e
from lmspd.api import wire
from lmspd.api.events import task_events
from lmspd.api.routing import AUTH, EVENTS_LMSP, GENERATE, INTAKE, LIMIT, Op, Operation, header, query
from lmspd.api.state import state_of
from lmspd.api.wire import (
    TaskList,
    ascii_int,
    decode,
    etag,
    fingerprint,
    idempotency_key,
    read_body,
    task_cursor,
    task_object,
)
from lmspd.errors import InvalidRequestError
from lmspd.responses import schema as s
from lmspd.responses.checks import accept
from lmspd.responses.enforce import SchemaError
from lmspd.responses.schema import TaskCreate
from lmspd.store.status import STATUSES


def _json(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json", headers=headers)


async def create_task(request: Request) -> Response:
    app = state_of(request)
    owner = app.auth.owner(request)
    key = idempotency_key(request)
    body = await read_body(request, app.config.server.max_body_bytes)
    envelope = decode(body, TaskCreate)
    try:
        accepted = accept(envelope.input, hosted_tools=app.config.responses.hosted_tools)
    except InvalidRequestError as exc:
        raise _within_input(exc) from exc
    try:
        task, replayed = await app.core.intake.submit(
            owner,
            accepted,
            kind="task",
            on_restart=envelope.on_restart,
            idempotency=(key, fingerprint(body)) if key else None,
        )
    except SchemaError as exc:  # checked in the core, off the event loop: a field of the request too
        raise _within_input(exc) from exc
    headers = {"Location": f"/lmsp/v1/tasks/{task.id}"}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return _json(task_object(task), 202, headers)


def _within_input(exc: InvalidRequestError) -> InvalidRequestError:
    """The error with its field named as the envelope holds it (``input.<field>``)."""
    return InvalidRequestError(exc.message, param=f"input.{exc.param}" if exc.param else "input")


async def get_task(request: Request) -> Response:
    app = state_of(request)
    task = await app.core.reads.task(request.path_params["task_id"], app.auth.owner(request))
    tag = etag(task)
    if request.headers.get("if-none-match") == tag:
        return Response(status_code=304, headers={"ETag": tag})
    return _json(task_object(task), headers={"ETag": tag})


async def list_tasks(request: Request) -> Response:
    app = state_of(request)
    owner = app.auth.owner(request)
    statuses = request.query_params.getlist("status")
    if bad := [s for s in statuses if s not in STATUSES]:
        raise InvalidRequestError(f"unknown status {bad[0]!r}", param="status")
    limit = ascii_int(request.query_params.get("limit", "20"), "limit", 1, 100)
    after = task_cursor(request.query_params.get("after"))
    tasks, has_more = await app.core.reads.tasks(owner, limit=limit, after=after, statuses=statuses or None)
    data = [task_object(t) for t in tasks]
    return _json(
        TaskList(
            data=data,
            has_more=has_more,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
        )
    )


async def cancel_task(request: Request) -> Response:
    app = state_of(request)
    task = await app.core.endings.cancel(request.path_params["task_id"], app.auth.owner(request))
    return _json(task_object(task))


ROUTES = [
    Operation(
        "/lmsp/v1/tasks",
        create_task,
        Op(
            "Create a durable task: answered once it is on disk",
            "lmsp",
            wire.TaskObject,
            status=202,
            request=s.TaskCreate,
            errors=(*AUTH, *GENERATE, e.IdempotencyKeyReusedError, *INTAKE),
            params=(header("Idempotency-Key", "1-255 printable ASCII characters; a retry with it replays the task"),),
            headers={
                "Location": "the task's URL",
                "Idempotent-Replayed": "`true` when an earlier request with this Idempotency-Key created the task",
            },
        ),
        "POST",
    ),
    Operation(
        "/lmsp/v1/tasks",
        list_tasks,
        Op(
            "List tasks, newest first",
            "lmsp",
            wire.TaskList,
            errors=(*AUTH, e.InvalidRequestError),
            params=(
                query("status", {"type": "array", "items": {"enum": list(STATUSES)}}, "only these statuses"),
                LIMIT,
                query("after", {"type": "string"}, "the last task id of the previous page"),
            ),
        ),
    ),
    Operation(
        "/lmsp/v1/tasks/{task_id}",
        get_task,
        Op(
            "A task: its status, and its response or error once finished",
            "lmsp",
            wire.TaskObject,
            errors=(*AUTH, e.TaskNotFoundError),
            params=(header("If-None-Match", "an ETag from an earlier answer"),),
            headers={"ETag": "changes when the task does"},
            other={304: ("not modified since the ETag sent", None)},
        ),
    ),
    Operation(
        "/lmsp/v1/tasks/{task_id}/cancel",
        cancel_task,
        Op(
            "Cancel a task (idempotent)",
            "lmsp",
            wire.TaskObject,
            errors=(*AUTH, e.TaskNotFoundError, e.TaskNotCancelableError),
        ),
        "POST",
    ),
    Operation(
        "/lmsp/v1/tasks/{task_id}/events",
        task_events,
        Op(
            "Follow a task's events (SSE), replaying from a resume point",
            "lmsp",
            events=(s.ResponseEvent,),
            events_only=True,
            lmsp_frames=True,
            errors=(*AUTH, e.InvalidRequestError, e.TaskNotFoundError, e.EventHistoryExpiredError),
            params=(
                header("Last-Event-ID", "resume after this sequence number (wins over `after`)"),
                query("after", {"type": "integer", "minimum": -1}, "resume after this sequence number"),
            ),
            description=EVENTS_LMSP,
        ),
    ),
]
