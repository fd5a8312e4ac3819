"""Models: the list with each one's state (LMSP and OpenAI shapes), and operators' control
calls (load, unload, pin) on ``/lmsp/v1/models/{name}/...`` (translation only: see
lmspd.core.lifecycle)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lmspd import errors as e
from lmspd.api import wire
from lmspd.api.routing import AUTH, Op, Operation, query
from lmspd.api.state import state_of
from lmspd.core.lifecycle import ModelView

Endpoint = Callable[[Request], Awaitable[Response]]
CONTROL_ERRORS = (*AUTH, e.ForbiddenError, e.ModelNotFoundError)


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def lmsp_model(v: ModelView) -> wire.LmspModel:
    return wire.LmspModel(id=v.id, ready=v.ready, **{k: getattr(v, k) for k in wire.STATE_FIELDS})


async def list_models(request: Request) -> Response:
    app = state_of(request)
    app.auth.owner(request)
    return _json(wire.LmspModelList(data=[lmsp_model(v) for v in await app.core.models.views()]))


async def list_openai_models(request: Request) -> Response:
    app = state_of(request)
    app.auth.owner(request)
    views = await app.core.models.views()
    # OpenAI's Model has id, object, created, owned_by; clients ignore the state beside them.
    return _json(
        wire.ModelList(data=[wire.Model(id=v.id, **{k: getattr(v, k) for k in wire.STATE_FIELDS}) for v in views])
    )


def _force(request: Request) -> bool:
    raw = request.query_params.get("force", "false")
    if raw not in ("true", "false"):
        raise e.InvalidRequestError(f"force must be true or false, got {raw[:20]!r}", param="force")
    return raw == "true"


async def load(request: Request) -> Response:
    app = state_of(request)
    app.auth.operator(request)
    return _json(lmsp_model(await app.core.models.load(request.path_params["name"])))


async def unload(request: Request) -> Response:
    app = state_of(request)
    app.auth.operator(request)
    force = _force(request)
    return _json(lmsp_model(await app.core.models.unload(request.path_params["name"], force=force)))


async def recycle(request: Request) -> Response:
    app = state_of(request)
    app.auth.operator(request)
    return _json(wire.Recycle(started=app.core.models.recycle_engine()), 202)


async def pin(request: Request) -> Response:
    app = state_of(request)
    app.auth.operator(request)
    return _json(lmsp_model(await app.core.models.pin(request.path_params["name"], True)))


async def unpin(request: Request) -> Response:
    app = state_of(request)
    app.auth.operator(request)
    return _json(lmsp_model(await app.core.models.pin(request.path_params["name"], False)))


_OPERATOR = "Needs an operator token (`server.admin_tokens`): an ordinary token gets 403."


def _control(action: str, handler: Endpoint, summary: str, **op: Any) -> Operation:
    """An operator's ``POST /lmsp/v1/models/{name}/<action>``, answering the model's state."""
    op.setdefault("errors", CONTROL_ERRORS)
    return Operation(
        f"/lmsp/v1/models/{{name}}/{action}",
        handler,
        Op(summary, "lmsp", wire.LmspModel, description=_OPERATOR, **op),
        "POST",
    )


ROUTES = [
    Operation(
        "/lmsp/v1/models",
        list_models,
        Op(
            "Models, each saying whether it is ready, loaded, how big and until when",
            "lmsp",
            wire.LmspModelList,
            errors=AUTH,
        ),
    ),
    _control("load", load, "Load a model now (it waits, as tasks do, for room)"),
    _control(
        "unload",
        unload,
        "Unload a model now",
        errors=(*CONTROL_ERRORS, e.ModelBusyError, e.InvalidRequestError),
        params=(query("force", {"type": "boolean", "default": False}, "cancel the tasks running on it (else 409)"),),
    ),
    _control("pin", pin, "Pin a model: it is never unloaded for being idle"),
    _control("unpin", unpin, "Unpin a model: its keep-alive applies again"),
    Operation(
        "/lmsp/v1/engine/recycle",
        recycle,
        Op(
            "Replace the engine while serving: running generations finish or resume on the next one",
            "lmsp",
            wire.Recycle,
            status=202,
            errors=(*AUTH, e.ForbiddenError),
            description=_OPERATOR,
        ),
        "POST",
    ),
]
MODELS = Operation("/v1/models", list_openai_models, Op("Models", "models", wire.ModelList, errors=AUTH))
