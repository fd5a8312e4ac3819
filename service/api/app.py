"""The app factory: every route of the service, in one place.

/healthz, /readyz                         liveness, readiness (no token)
/openapi.json                             this app's OpenAPI document (no token) -> lmspd.api.openapi
/metrics                                  Prometheus metrics        -> lmspd.metrics
/lmsp/v1/capabilities, /lmsp/v1/models    discovery (LMSP 10)
/lmsp/v1/tasks[...]                       durable tasks (LMSP 7)  -> lmspd.api.tasks
/lmsp/v1/tasks/{id}/events                event stream (LMSP 6.4) -> lmspd.api.events
/v1/responses[...], /lmsp/v1/responses[/compact]  OpenAI Responses API -> lmspd.api.responses
/v1/chat/completions                      Chat Completions view   -> lmspd.api.chat
Every handler translates HTTP to one call of the service layer, lmspd.core.Core.
Every request is logged, once, by lmspd.api.access_log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lmspd.api import chat, events, openapi, responses, tasks
from lmspd.api.access_log import AccessLog
from lmspd.api.auth import Authenticator
from lmspd.api.problems import is_openai_path, openai_response, problem_response
from lmspd.api.state import AppState, state_of
from lmspd.api.wire import Capabilities, CapabilityFlags, Health, Limits, LmspModel, LmspModelList
from lmspd.config import Config
from lmspd.core import Core
from lmspd.core.hub import Hub
from lmspd.core.supervisor import Supervisor
from lmspd.engine.process import EngineClient
from lmspd.engine.protocol import SamplingParams
from lmspd.errors import InvalidRequestError, LmspdError, MethodNotAllowedError, NotFoundError, StorageFullError
from lmspd.metrics import CONTENT_TYPE, Metrics
from lmspd.models.registry import ModelRegistry
from lmspd.prompting.generation import check_request
from lmspd.store.db import Database
from lmspd.store.task_store import TaskStore

log = logging.getLogger("lmspd.server")


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


async def healthz(request: Request) -> Response:
    return _json(Health("ok"))


async def readyz(request: Request) -> Response:
    app = state_of(request)
    ready = app.core.accepting and app.core.supervisor.engine.alive
    return _json(Health("ready" if ready else "not_ready"), 200 if ready else 503)


async def capabilities(request: Request) -> Response:
    app = state_of(request)
    app.auth.owner(request)
    s = app.config.server
    return _json(
        Capabilities(
            lmsp_version="1.0",
            capabilities=CapabilityFlags(event_resume=True, resume_snapshots=True, idempotency=True, tasks=True),
            task_types=["response"],
            on_restart=["fail", "retry", "resume"],
            limits=Limits(
                max_body_bytes=s.max_body_bytes,
                max_queued_tasks=s.max_queued_tasks,
                max_concurrency=app.config.engine.max_concurrency,
                event_retention_secs=s.event_retention_secs,
                task_retention_secs=s.task_retention_secs,
                idempotency_key_retention_secs=s.idempotency_retention_secs,
            ),
        )
    )


async def models(request: Request) -> Response:
    app = state_of(request)
    app.auth.owner(request)
    return _json(LmspModelList(data=[LmspModel(id=m.name, ready=m.pulled) for m in app.core.models()]))


async def openapi_json(request: Request) -> Response:
    body: bytes | None = getattr(request.app.state, "openapi", None)
    if body is None:  # built once per app, from its own routes
        body = request.app.state.openapi = msgspec.json.encode(openapi.document(request.app.routes))
    return Response(body, media_type="application/json")


async def scrape(request: Request) -> Response:
    app = state_of(request)
    app.auth.owner(request)  # a token when tokens are configured, as everywhere but the probes
    return Response(await app.core.metrics_text(), media_type=CONTENT_TYPE)


def _render(request: Request, exc: LmspdError) -> Response:
    return openai_response(exc) if is_openai_path(request.url.path) else problem_response(exc)


async def on_lmspd_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, LmspdError)
    return _render(request, exc)


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: NotFoundError, 405: MethodNotAllowedError}.get(exc.status_code, InvalidRequestError)
    return _render(request, kind(str(exc.detail)))


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return _render(request, LmspdError("internal server error"))


def _openai_routes(prefix: str) -> list[Route]:
    return [
        Route(f"{prefix}/responses", responses.create_response, methods=["POST"]),
        Route(f"{prefix}/responses/input_tokens", responses.input_tokens, methods=["POST"]),
        Route(f"{prefix}/responses/compact", responses.compact, methods=["POST"]),
        Route(f"{prefix}/responses/{{response_id}}", responses.get_response, methods=["GET"]),
        Route(f"{prefix}/responses/{{response_id}}", responses.delete_response, methods=["DELETE"]),
        Route(f"{prefix}/responses/{{response_id}}/cancel", responses.cancel_response, methods=["POST"]),
        Route(f"{prefix}/responses/{{response_id}}/input_items", responses.list_input_items, methods=["GET"]),
        Route(f"{prefix}/chat/completions", chat.create_chat_completion, methods=["POST"]),
    ]


ROUTES = [
    Route("/healthz", healthz),
    Route("/lmsp/v1/healthz", healthz),  # clients guess it
    Route("/readyz", readyz),
    Route("/openapi.json", openapi_json),
    Route("/metrics", scrape),
    Route("/lmsp/v1/capabilities", capabilities),
    Route("/lmsp/v1/models", models),
    Route("/lmsp/v1/tasks", tasks.create_task, methods=["POST"]),
    Route("/lmsp/v1/tasks", tasks.list_tasks, methods=["GET"]),
    Route("/lmsp/v1/tasks/{task_id}", tasks.get_task, methods=["GET"]),
    Route("/lmsp/v1/tasks/{task_id}/cancel", tasks.cancel_task, methods=["POST"]),
    Route("/lmsp/v1/tasks/{task_id}/events", events.task_events, methods=["GET"]),
    Route("/lmsp/v1/responses", responses.create_response, methods=["POST"]),
    Route("/lmsp/v1/responses/compact", responses.compact, methods=["POST"]),
    # OpenAI Responses API, with and without /v1 (errors in OpenAI's envelope)
    *_openai_routes("/v1"),
    *_openai_routes(""),
    Route("/v1/models", responses.list_models),
]


async def _janitor(config: Config, store: TaskStore) -> None:
    s = config.server
    while True:
        await asyncio.sleep(s.janitor_interval_secs)
        try:
            counts = await store.purge(
                event_retention_secs=s.event_retention_secs,
                task_retention_secs=s.task_retention_secs,
                idempotency_retention_secs=s.idempotency_retention_secs,
            )
            evicted = await store.enforce_response_limits(config.responses)
            log.info("retention purge: %s; response store evictions: %d", counts, evicted)
        except StorageFullError as exc:
            log.warning("retention purge postponed: %s", exc.message)
        except Exception:
            log.exception("retention purge failed")


def _warm_up(config: Config, registry: ModelRegistry) -> None:
    """Load the default model's tokenizer and compile its chat template before the first request."""
    with contextlib.suppress(LmspdError):
        if (model := registry.resolve_local(config.default_model)) is not None:
            check_request(model, [{"role": "user", "content": "warm-up"}], SamplingParams())


def create_app(config: Config, engine: EngineClient | None = None, shutdown: asyncio.Event | None = None) -> Starlette:
    """The app. ``engine``: one the caller started and keeps (tests share one); ``shutdown``:
    set by the process on SIGTERM, so intake stops and event streams end before the server
    waits for open connections."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Whatever started is stopped again, in reverse order, also when a later step fails:
        # an open database or engine left behind keeps a failed server alive, never serving.
        async with contextlib.AsyncExitStack() as stack:
            try:
                await _start(app, stack)
            except Exception as exc:
                app.state.startup_error = exc  # for `lmspd serve`, which says why in one line
                raise
            yield

    async def _start(app: Starlette, stack: contextlib.AsyncExitStack) -> None:
        metrics = Metrics()  # this app's own registry: many apps may share a process
        db = await Database.open(config.server.database_path, on_commit=metrics.observe_commit)
        stack.push_async_callback(db.close)
        store = TaskStore(db, max_queued=config.server.max_queued_tasks, metrics=metrics)
        hub = Hub()
        registry = ModelRegistry(config)
        runner = engine or EngineClient(config.engine, config.server.prompt_cache_dir)
        supervisor = Supervisor(config, store, runner, hub, registry, metrics)
        # A handed-in engine is the caller's to close.
        stack.push_async_callback(supervisor.stop, close_engine=engine is None)
        await supervisor.start()  # recovers unfinished tasks before any request is served
        # Foreground store:false responses a crash left between their end and their release. Only
        # at start: while serving, a slow reader may still be streaming a finished one.
        with contextlib.suppress(StorageFullError):  # deleting needs room too: the janitor retries
            await store.delete_finished_unstored()
        core = Core(config, store, hub, supervisor, registry, metrics)
        stack.push_async_callback(core.close)
        app.state.lmsp = AppState(config, core, Authenticator(config.server.tokens))
        await asyncio.to_thread(_warm_up, config, registry)
        chores = [asyncio.create_task(_janitor(config, store))]
        if shutdown is not None:
            chores.append(asyncio.create_task(_on_shutdown(shutdown, core)))
        for chore in chores:
            stack.callback(chore.cancel)

    return Starlette(
        routes=ROUTES,
        middleware=[Middleware(AccessLog)],
        lifespan=lifespan,
        exception_handlers={LmspdError: on_lmspd_error, HTTPException: on_http_error, Exception: on_unexpected},
    )


async def _on_shutdown(shutdown: asyncio.Event, core: Core) -> None:
    await shutdown.wait()
    log.info("shutting down: no new work; in-flight tasks stay recoverable by their policy")
    core.begin_shutdown()
