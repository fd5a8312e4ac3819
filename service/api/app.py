"""The app factory and the route table: every route of the service, in one place, with the
handler module and the part of the core (lmspd.core.service) it calls.

/healthz, /readyz                         liveness, readiness (no token)        -> core.status
/openapi.json                             this app's OpenAPI document (no token) -> lmspd.api.openapi
/metrics                                  Prometheus metrics (operators)        -> core.status
/lmsp/v1/capabilities                     discovery (docs/lmsp.md §10)          -> the config
/lmsp/v1/models[...], /v1/models          models                -> lmspd.api.models: core.models
/lmsp/v1/tasks[...]                       durable tasks (docs/lmsp.md §7)
                                          -> lmspd.api.tasks: core.intake, core.reads, core.endings
/lmsp/v1/tasks/{id}/events                event stream (docs/lmsp.md §6.4) -> lmspd.api.events: core.reads
/v1/responses[...], /lmsp/v1/responses    OpenAI Responses API
                                          -> lmspd.api.responses: core.intake, core.reads, core.endings
/v1/responses/compact                     -> lmspd.api.responses: core.compaction
/v1/chat/completions                      Chat Completions view   -> lmspd.api.chat: the same
/v1/messages[/count_tokens]               Anthropic Messages view -> lmspd.api.messages: the same
/lmsp/v1/summary                          the server at a glance (the console) -> lmspd.api.summary: core.status
/lmsp/v1/cluster                          the nodes (PostgreSQL) -> lmspd.api.cluster: core.cluster
/, /console/*                             the web console (no token) -> lmspd.api.console
Each route carries its OpenAPI contract (lmspd.api.routing); the service behind the app is
built by lmspd.core.runtime. Every handler translates HTTP to calls of the core's parts, and
nothing else; every request is logged, once, by lmspd.api.access_log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response

from lmspd.api import chat, cluster, console, events, messages, models, openapi, responses, summary, tasks, wire
from lmspd.api.access_log import AccessLog
from lmspd.api.auth import Authenticator
from lmspd.api.guard import HostPolicy, RequestGuard, is_loopback
from lmspd.api.problems import error_response
from lmspd.api.responses import OMITTED_TOOLS_HEADER
from lmspd.api.routing import AUTH, Op, Operation
from lmspd.api.state import AppState, state_of
from lmspd.api.wire import Capabilities, CapabilityFlags, Health, Limits
from lmspd.config import Config
from lmspd.core import runtime
from lmspd.engine.process import EngineClient
from lmspd.errors import ForbiddenError, InvalidRequestError, LmspdError, MethodNotAllowedError, NotFoundError
from lmspd.metrics import CONTENT_TYPE

log = logging.getLogger("lmspd.server")


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


async def healthz(request: Request) -> Response:
    return _json(Health("ok"))


async def readyz(request: Request) -> Response:
    status = state_of(request).core.status
    why = status.not_ready()
    return _json(
        Health("ready", status.serving_alone()) if why is None else Health("not_ready", why),
        200 if why is None else 503,
    )


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


async def openapi_json(request: Request) -> Response:
    body: bytes | None = getattr(request.app.state, "openapi", None)
    if body is None:  # built once per app, from its own routes
        body = request.app.state.openapi = msgspec.json.encode(openapi.document(request.app.routes))
    return Response(body, media_type="application/json")


async def scrape(request: Request) -> Response:
    app = state_of(request)
    # Server-wide figures (every tenant's queue among them): operators' alone once tokens are
    # configured; without tokens (loopback only) anyone local may (docs/operations.md, "Metrics").
    app.auth.operator(request)
    return Response(await app.core.status.metrics_text(), media_type=CONTENT_TYPE)


def _render(request: Request, exc: LmspdError) -> Response:
    return error_response(request.url.path, exc)


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


ROUTES = [
    Operation("/healthz", healthz, Op("Liveness", "health", wire.Health, auth=False)),
    Operation("/lmsp/v1/healthz", healthz, Op("Liveness", "health", wire.Health, auth=False)),  # clients guess it
    Operation(
        "/readyz",
        readyz,
        Op(
            "Readiness: accepting work, the engine up and the default model able to load",
            "health",
            wire.Health,
            auth=False,
            other={
                503: (
                    "not ready, `reason` saying why: shutting down, the engine down, or the default model "
                    "unable to load (the memory budget refuses it)",
                    wire.Health,
                )
            },
        ),
    ),
    Operation("/openapi.json", openapi_json, Op("This OpenAPI document", "meta", dict[str, Any], auth=False)),
    Operation(
        "/metrics",
        scrape,
        Op(
            "Metrics in the Prometheus text format",
            "meta",
            str,
            errors=(*AUTH, ForbiddenError),
            media="text/plain; version=0.0.4; charset=utf-8",
            description=(
                "Counters, gauges and histograms of tasks, tokens, latency, the engine, streams and the store, "
                "server-wide. Needs an operator token (`server.admin_tokens`) when tokens are configured: "
                "an ordinary token gets 403."
            ),
        ),
    ),
    Operation(
        "/lmsp/v1/capabilities",
        capabilities,
        Op("LMSP capabilities and limits (LMSP 10)", "lmsp", wire.Capabilities, errors=AUTH),
    ),
    *models.ROUTES,
    summary.ROUTE,
    *cluster.ROUTES,
    *tasks.ROUTES,
    *responses.LMSP_ROUTES,
    # OpenAI Responses API, with and without /v1 (errors in OpenAI's envelope)
    *responses.routes("/v1"),
    chat.route("/v1"),
    *responses.routes(""),
    chat.route(""),
    # Anthropic Messages API, with and without /v1 (errors in Anthropic's envelope)
    *messages.routes("/v1"),
    *messages.routes(""),
    models.MODELS,
    *console.ROUTES,
]


def middleware(config: Config) -> list[Middleware]:
    """Outermost first: every request is logged, refusals too; the guard refuses before any
    route runs; CORS grants only ``[server] allowed_origins`` (docs/operations.md, "Security")."""
    s = config.server
    hosts = HostPolicy([*s.allowed_hosts, s.host], listens_beyond_loopback=not is_loopback(s.host))
    stack = [Middleware(AccessLog), Middleware(RequestGuard, hosts=hosts, origins=s.allowed_origins)]
    if s.allowed_origins:
        stack.append(
            Middleware(
                CORSMiddleware,
                allow_origins=s.allowed_origins,
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["Location", "ETag", "Retry-After", "Idempotent-Replayed", OMITTED_TOOLS_HEADER],
                max_age=600,
            )
        )
    return stack


def create_app(config: Config, engine: EngineClient | None = None, shutdown: asyncio.Event | None = None) -> Starlette:
    """The app, serving the service :func:`lmspd.core.runtime.started` builds (``engine`` and
    ``shutdown`` are passed on to it)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            try:
                core = await stack.enter_async_context(runtime.started(config, engine, shutdown))
            except Exception as exc:
                app.state.startup_error = exc  # for `lmspd serve`, which says why in one line
                raise
            app.state.lmsp = AppState(config, core, Authenticator(config.server.tokens, config.server.admin_tokens))
            yield

    return Starlette(
        routes=ROUTES,
        middleware=middleware(config),
        lifespan=lifespan,
        exception_handlers={
            LmspdError: on_lmspd_error,
            HTTPException: on_http_error,
            events.ClientGone: events.client_gone,
            Exception: on_unexpected,
        },
    )
