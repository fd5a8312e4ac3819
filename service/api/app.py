"""The app factory: every route of the service, in one place.

/healthz, /readyz                         liveness, readiness (no token)
/lmsp/v1/capabilities, /lmsp/v1/models    discovery (LMSP 10)
/lmsp/v1/tasks[...]                       durable tasks (LMSP 7)  -> service.api.tasks
/lmsp/v1/tasks/{id}/events                event stream (LMSP 6.4) -> service.api.events
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from service.api import events, responses, tasks
from service.api.auth import Authenticator
from service.api.problems import from_error, openai_error, problem, problem_response
from service.api.state import AppState
from service.config import Config
from service.engine.client import EngineClient
from service.engine.protocol import SamplingParams
from service.errors import LmspdError, QueueFullError
from service.generation import check_request
from service.hub import Hub
from service.models.registry import ModelRegistry
from service.store.db import Database
from service.store.tasks import TaskStore
from service.supervisor import Supervisor

log = logging.getLogger("lmspd.server")


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


async def healthz(request: Request) -> Response:
    return _json({"status": "ok"})


async def readyz(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    ready = app.accepting and app.supervisor.engine.alive
    return _json({"status": "ready" if ready else "not_ready"}, 200 if ready else 503)


async def capabilities(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    app.auth.owner(request)
    s = app.config.server
    return _json(
        {
            "object": "capabilities",
            "lmsp_version": "1.0",
            "capabilities": {"event_resume": True, "resume_snapshots": True, "idempotency": True, "tasks": True},
            "task_types": ["response"],
            "on_restart": ["fail", "retry", "resume"],
            "limits": {
                "max_body_bytes": s.max_body_bytes,
                "max_queued_tasks": s.max_queued_tasks,
                "max_concurrency": app.config.engine.max_concurrency,
                "event_retention_secs": s.event_retention_secs,
                "task_retention_secs": s.task_retention_secs,
                "idempotency_key_retention_secs": s.idempotency_retention_secs,
            },
        }
    )


async def models(request: Request) -> Response:
    app: AppState = request.app.state.lmsp
    app.auth.owner(request)
    data = [
        {"id": m.name, "object": "model", "created": 0, "owned_by": "lmspd", "ready": m.pulled}
        for m in app.registry.list()
    ]
    return _json({"object": "list", "data": data})


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith(("/v1/", "/responses"))


async def on_lmspd_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LmspdError)
    p = from_error(exc)
    headers = {}
    if p.status in (429, 503):
        headers["Retry-After"] = "1"
    if p.code == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"
    if _is_openai(request):
        if isinstance(exc, QueueFullError):  # /v1: a full queue is "overloaded", as the seed has it
            p = problem("server_overloaded", exc.message, status=503)
        return openai_error(p, headers)
    return problem_response(p, headers)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else "invalid_request"
    p = problem(code, str(exc.detail), status=exc.status_code)
    return openai_error(p) if _is_openai(request) else problem_response(p)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    p = problem("server_error", "internal server error", status=500)
    return openai_error(p) if _is_openai(request) else problem_response(p)


def _openai_routes(prefix: str) -> list[Route]:
    return [
        Route(f"{prefix}/responses", responses.create_response, methods=["POST"]),
        Route(f"{prefix}/responses/input_tokens", responses.input_tokens, methods=["POST"]),
        Route(f"{prefix}/responses/{{response_id}}", responses.get_response, methods=["GET"]),
        Route(f"{prefix}/responses/{{response_id}}", responses.delete_response, methods=["DELETE"]),
        Route(f"{prefix}/responses/{{response_id}}/cancel", responses.cancel_response, methods=["POST"]),
    ]


ROUTES = [
    Route("/healthz", healthz),
    Route("/readyz", readyz),
    Route("/lmsp/v1/capabilities", capabilities),
    Route("/lmsp/v1/models", models),
    Route("/lmsp/v1/tasks", tasks.create_task, methods=["POST"]),
    Route("/lmsp/v1/tasks", tasks.list_tasks, methods=["GET"]),
    Route("/lmsp/v1/tasks/{task_id}", tasks.get_task, methods=["GET"]),
    Route("/lmsp/v1/tasks/{task_id}/cancel", tasks.cancel_task, methods=["POST"]),
    Route("/lmsp/v1/tasks/{task_id}/events", events.task_events, methods=["GET"]),
    Route("/lmsp/v1/responses", responses.create_response, methods=["POST"]),
    # OpenAI Responses API, with and without /v1 (errors in OpenAI's envelope)
    *_openai_routes("/v1"),
    *_openai_routes(""),
    Route("/v1/models", responses.list_models),
]


async def _janitor(state: AppState) -> None:
    s = state.config.server
    while True:
        await asyncio.sleep(s.janitor_interval_secs)
        try:
            counts = await state.store.purge(
                event_retention_secs=s.event_retention_secs,
                task_retention_secs=s.task_retention_secs,
                idempotency_retention_secs=s.idempotency_retention_secs,
            )
            evicted = await state.store.enforce_response_limits(state.config.responses)
            log.info("retention purge: %s; response store evictions: %d", counts, evicted)
        except Exception:
            log.exception("retention purge failed")


def _warm_up(state: AppState) -> None:
    """Load the default model's tokenizer and compile its chat template before the first request."""
    with contextlib.suppress(LmspdError):
        if (model := state.registry.resolve_local(state.config.default_model)) is not None:
            check_request(model, [{"role": "user", "content": "warm-up"}], SamplingParams())


def create_app(config: Config, engine: EngineClient | None = None) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        db = await Database.open(config.server.database_path)
        store = TaskStore(db, max_queued=config.server.max_queued_tasks)
        hub = Hub()
        registry = ModelRegistry(config)
        supervisor = Supervisor(config, store, engine or EngineClient(config.engine), hub, registry)
        await supervisor.start()  # recovers unfinished tasks before any request is served
        state = AppState(config, db, store, hub, supervisor, Authenticator(config.server.tokens), registry)
        app.state.lmsp = state
        await asyncio.to_thread(_warm_up, state)
        janitor = asyncio.create_task(_janitor(state))
        try:
            yield
        finally:
            state.accepting = False
            hub.close()
            janitor.cancel()
            await supervisor.stop(close_engine=engine is None)  # a handed-in engine is the caller's
            await db.close()

    return Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={LmspdError: on_lmspd_error, HTTPException: on_http_error, Exception: on_unexpected},
    )
