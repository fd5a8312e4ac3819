"""The app's OpenAPI 3.1 document, generated from its routes and the msgspec Structs they speak.

Each handler has one :class:`Op` below: its request and response bodies (Structs, turned into
JSON Schema by ``msgspec.json.schema_components``), its SSE payload if it streams, its
parameters and the errors it can answer. The paths come from the app's routes themselves, and
a route whose handler has no ``Op`` is an error, so the document cannot drift from the app.
Errors are rendered per path like the app renders them (``lmspd.api.problems``): OpenAI's
envelope on /v1 and its aliases, RFC 9457 problem objects on /lmsp/v1 and the health routes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
from starlette.routing import BaseRoute, Route

from lmspd import __version__
from lmspd import errors as e
from lmspd.api import wire
from lmspd.api.problems import OpenAIError, is_openai_path
from lmspd.chat.schema import ChatCompletionRequest
from lmspd.chat.view import ChatCompletion, ChatCompletionChunk, ChatError
from lmspd.responses import schema as s
from lmspd.responses.items import INCLUDABLE, InputItemList
from lmspd.store.status import STATUSES

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{name}"
_PATH_PARAM = re.compile(r"{(\w+)}")


@dataclass(frozen=True)
class Param:
    name: str
    where: str  # "query" | "header"
    schema: dict[str, Any]
    description: str

    def render(self) -> dict[str, Any]:
        return {"name": self.name, "in": self.where, "required": False, "description": self.description} | {
            "schema": self.schema
        }


@dataclass(frozen=True)
class Op:
    """One handler's contract. Types are Structs or unions of tagged Structs."""

    summary: str
    tag: str
    response: Any = None  # the success body (JSON); None: no body
    status: int = 200
    request: Any = None  # the JSON request body
    events: tuple[Any, ...] = ()  # SSE ``data:`` payloads, when the operation streams
    events_only: bool = False  # the success answer is always a stream
    lmsp_frames: bool = False  # SSE framed as LMSP's (``id:`` per event, no ``[DONE]``) rather than OpenAI's
    errors: tuple[type[e.LmspdError], ...] = ()
    params: tuple[Param, ...] = ()
    auth: bool = True
    headers: dict[str, str] = field(default_factory=dict)  # success response headers -> description
    other: dict[int, tuple[str, Any]] = field(default_factory=dict)  # status -> (description, body or None)
    description: str = ""
    media: str = "application/json"  # the success body's media type (a non-JSON one is text)


def _query(name: str, schema: dict[str, Any], description: str) -> Param:
    return Param(name, "query", schema, description)


def _header(name: str, description: str) -> Param:
    return Param(name, "header", {"type": "string"}, description)


# --- the contracts, by handler ---------------------------------------------------------------

_AUTH = (e.UnauthorizedError,)
_BODY = (e.InvalidRequestError, e.PayloadTooLargeError, e.UnsupportedMediaTypeError)
_GENERATE = (*_BODY, e.ContextLengthExceededError, e.UnsupportedCapabilityError, e.ModelNotFoundError)
_INTAKE = (e.QueueFullError, e.ServerOverloadedError)

_LIMIT = _query("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}, "page size")
_IDEMPOTENCY_KEY = _header("Idempotency-Key", "1-255 printable ASCII characters; a retry with it replays the task")
_EVENTS_LMSP = (
    "LMSP event stream (LMSP 6.4): `retry: 2000`, then per event `id: <sequence number>`, "
    "`event: <type>` and `data: <JSON>` (described here), `: keep-alive` comments while idle; it "
    "ends when the task does. Resume with `Last-Event-ID` (or `?after=`): no gap, no duplicate."
)
_EVENTS_OPENAI = (
    "OpenAI server-sent events: per event `event: <type>` and `data: <JSON>` (described here), then `data: [DONE]`."
)


def _operations() -> dict[str, Op]:
    from lmspd.api import app, chat, events, responses, tasks

    ops: dict[Callable[..., Any], Op] = {
        app.healthz: Op("Liveness", "health", wire.Health, auth=False),
        app.readyz: Op(
            "Readiness: accepting work and the engine is up",
            "health",
            wire.Health,
            auth=False,
            other={503: ("not ready (starting, shutting down or the engine is down)", wire.Health)},
        ),
        app.openapi_json: Op("This OpenAPI document", "meta", dict[str, Any], auth=False),
        app.scrape: Op(
            "Metrics in the Prometheus text format",
            "meta",
            str,
            errors=_AUTH,
            media="text/plain; version=0.0.4; charset=utf-8",
            description="Counters, gauges and histograms of tasks, tokens, latency, the engine, streams and the store.",
        ),
        app.capabilities: Op("LMSP capabilities and limits (LMSP 10)", "lmsp", wire.Capabilities, errors=_AUTH),
        app.models: Op("Models, each saying whether it is ready", "lmsp", wire.LmspModelList, errors=_AUTH),
        tasks.create_task: Op(
            "Create a durable task: answered once it is on disk",
            "lmsp",
            wire.TaskObject,
            status=202,
            request=s.TaskCreate,
            errors=(*_AUTH, *_GENERATE, e.IdempotencyKeyReusedError, *_INTAKE),
            params=(_IDEMPOTENCY_KEY,),
            headers={
                "Location": "the task's URL",
                "Idempotent-Replayed": "`true` when an earlier request with this Idempotency-Key created the task",
            },
        ),
        tasks.list_tasks: Op(
            "List tasks, newest first",
            "lmsp",
            wire.TaskList,
            errors=(*_AUTH, e.InvalidRequestError),
            params=(
                _query("status", {"type": "array", "items": {"enum": list(STATUSES)}}, "only these statuses"),
                _LIMIT,
                _query("after", {"type": "string"}, "the last task id of the previous page"),
            ),
        ),
        tasks.get_task: Op(
            "A task: its status, and its response or error once finished",
            "lmsp",
            wire.TaskObject,
            errors=(*_AUTH, e.TaskNotFoundError),
            params=(_header("If-None-Match", "an ETag from an earlier answer"),),
            headers={"ETag": "changes when the task does"},
            other={304: ("not modified since the ETag sent", None)},
        ),
        tasks.cancel_task: Op(
            "Cancel a task (idempotent)",
            "lmsp",
            wire.TaskObject,
            errors=(*_AUTH, e.TaskNotFoundError, e.TaskNotCancelableError),
        ),
        events.task_events: Op(
            "Follow a task's events (SSE), replaying from a resume point",
            "lmsp",
            events=(s.ResponseEvent,),
            events_only=True,
            lmsp_frames=True,
            errors=(*_AUTH, e.InvalidRequestError, e.TaskNotFoundError, e.EventHistoryExpiredError),
            params=(
                _header("Last-Event-ID", "resume after this sequence number (wins over `after`)"),
                _query("after", {"type": "integer", "minimum": -1}, "resume after this sequence number"),
            ),
            description=_EVENTS_LMSP,
        ),
        responses.create_response: Op(
            "Create a response: synchronous, streamed (`stream: true`) or in the background",
            "responses",
            s.Response,
            request=s.ResponseRequest,
            events=(s.ResponseEvent,),
            errors=(*_AUTH, *_GENERATE, e.IdempotencyKeyReusedError, e.TooManyBackgroundJobsError, *_INTAKE),
            params=(_header("Idempotency-Key", "background requests only: a retry with it replays the response"),),
            description=_EVENTS_OPENAI,
        ),
        responses.input_tokens: Op(
            "Count a request's input tokens, history included",
            "responses",
            wire.InputTokens,
            request=s.ResponseRequest,
            errors=(*_AUTH, *_GENERATE),
        ),
        responses.compact: Op(
            "Compact a history into one compaction item (stores nothing)",
            "responses",
            s.CompactResponse,
            request=s.CompactRequest,
            errors=(*_AUTH, *_GENERATE, *_INTAKE),
        ),
        responses.get_response: Op(
            "A stored response; `?stream=true` replays and follows its events",
            "responses",
            s.Response,
            events=(s.ResponseEvent,),
            errors=(*_AUTH, e.InvalidRequestError, e.NotFoundError),
            params=(
                _query("stream", {"type": "boolean"}, "stream the response's events"),
                _query("starting_after", {"type": "integer", "minimum": -1}, "with stream: after this sequence number"),
            ),
            description=_EVENTS_OPENAI,
        ),
        responses.delete_response: Op(
            "Delete a stored response (an unfinished background one: cancel first)",
            "responses",
            wire.DeletedResponse,
            errors=(*_AUTH, e.InvalidRequestError, e.NotFoundError),
        ),
        responses.cancel_response: Op(
            "Cancel a response (idempotent; a finished one comes back unchanged)",
            "responses",
            s.Response,
            errors=(*_AUTH, e.NotFoundError),
        ),
        responses.list_input_items: Op(
            "A response's input items",
            "responses",
            InputItemList,
            errors=(*_AUTH, e.InvalidRequestError, e.NotFoundError),
            params=(
                _LIMIT,
                _query("order", {"enum": ["asc", "desc"], "default": "desc"}, "by position in the input"),
                _query("after", {"type": "string"}, "the last item id of the previous page"),
                _query(
                    "include", {"type": "array", "items": {"enum": sorted(INCLUDABLE)}}, "accepted, changes nothing"
                ),
            ),
        ),
        responses.list_models: Op("Models", "models", wire.ModelList, errors=_AUTH),
        chat.create_chat_completion: Op(
            "Chat Completions (not stored); `stream: true` streams chunks",
            "chat",
            ChatCompletion,
            request=ChatCompletionRequest,
            events=(ChatCompletionChunk, ChatError),
            errors=(*_AUTH, *_GENERATE, *_INTAKE),
            description=_EVENTS_OPENAI + " A generation that fails mid-stream sends an error object as its last data.",
        ),
    }
    return {_key(fn): op for fn, op in ops.items()}


def _key(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__.rpartition('.')[2]}.{fn.__qualname__}"


# --- rendering -------------------------------------------------------------------------------


class _Schemas:
    """Collects every type the document names and renders them once as components."""

    NAMED: ClassVar[dict[str, Any]] = {"ResponseEvent": s.ResponseEvent}  # unions worth a component of their own

    def __init__(self) -> None:
        self._index: dict[Any, int] = {}

    def ref(self, kind: Any) -> dict[str, Any]:
        index = self._index.setdefault(kind, len(self._index))
        return {"$ref": f"#/$types/{index}"}  # a placeholder, replaced in resolve()

    def resolve(self, doc: Any) -> dict[str, Any]:
        kinds = list(self._index)
        schemas, components = msgspec.json.schema_components(kinds, ref_template=REF)
        refs = list(schemas)
        for name, kind in self.NAMED.items():
            if kind in self._index:
                components[name] = refs[self._index[kind]]
                refs[self._index[kind]] = {"$ref": REF.format(name=name)}

        def walk(node: Any) -> Any:
            if isinstance(node, dict):
                target = node.get("$ref", "")
                if isinstance(target, str) and target.startswith("#/$types/"):
                    return refs[int(target.rpartition("/")[2])]
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, list):
                return [walk(v) for v in node]
            return node

        resolved: dict[str, Any] = walk(doc)
        resolved["components"]["schemas"] = dict(sorted(components.items()))
        return resolved


def _error_responses(errors: Iterable[type[e.LmspdError]], *, openai: bool, schemas: _Schemas) -> dict[str, Any]:
    by_status: dict[int, list[type[e.LmspdError]]] = {}
    for cls in errors:
        status = (cls.openai_status or cls.status) if openai else cls.status
        by_status.setdefault(status, []).append(cls)
    media, body = ("application/json", OpenAIError) if openai else ("application/problem+json", e.Problem)
    content = {media: {"schema": schemas.ref(body)}}
    out: dict[str, Any] = {}
    for status in sorted(by_status):
        codes = [(cls.title, cls.openai_code if openai else cls.code) for cls in by_status[status]]
        described = "; ".join(f"{title} (`{code}`)" if code else title for title, code in dict.fromkeys(codes))
        response: dict[str, Any] = {"description": described, "content": content}
        if status in (429, 503):
            response["headers"] = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
        elif status == 401:
            response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        out[str(status)] = response
    out["default"] = {"description": "Internal server error (`server_error`)", "content": content}
    return out


def _events_schema(op: Op, schemas: _Schemas) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 has ``schema`` describe each event of a stream): its
    ``data`` is JSON text of one of ``op.events``; /v1 streams end with ``data: [DONE]``."""
    refs = [schemas.ref(kind) for kind in op.events]
    payload = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": refs[0] if len(refs) == 1 else {"anyOf": refs},
    }
    fields: dict[str, Any] = {
        "event": {"type": "string"},
        "data": payload if op.lmsp_frames else {"anyOf": [{"const": "[DONE]"}, payload]},
        "retry": {"type": "integer"},
    }
    if op.lmsp_frames:
        fields["id"] = {"type": "string", "pattern": "^[0-9]+$", "description": "the event's sequence number"}
    return {"type": "object", "properties": fields}


def _operation(path: str, method: str, op: Op, schemas: _Schemas) -> dict[str, Any]:
    openai = is_openai_path(path)
    alias = openai and not path.startswith("/v1/")
    out: dict[str, Any] = {
        "operationId": re.sub(r"[^A-Za-z0-9]+", "_", f"{method} {path}").strip("_"),
        "summary": op.summary,
        "tags": [op.tag],
    }
    description = f"Alias of `/v1{path}`. {op.description}" if alias else op.description
    if description.strip():
        out["description"] = description.strip()
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PATH_PARAM.findall(path)
    ]
    params += [p.render() for p in op.params]
    if params:
        out["parameters"] = params
    if op.request is not None:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": schemas.ref(op.request)}}}
    content: dict[str, Any] = {}
    if op.response is not None and not op.events_only:
        schema = schemas.ref(op.response) if op.media == "application/json" else {"type": "string"}
        content[op.media] = {"schema": schema}
    if op.events:
        content["text/event-stream"] = {"schema": _events_schema(op, schemas)}
    ok: dict[str, Any] = {"description": op.summary}
    if op.headers:
        ok["headers"] = {name: {"description": text, "schema": {"type": "string"}} for name, text in op.headers.items()}
    if content:
        ok["content"] = content
    responses: dict[str, Any] = {str(op.status): ok}
    for status, (text, body) in op.other.items():
        responses[str(status)] = {"description": text} | (
            {"content": {"application/json": {"schema": schemas.ref(body)}}} if body is not None else {}
        )
    responses |= _error_responses(op.errors, openai=openai, schemas=schemas)
    out["responses"] = dict(sorted(responses.items(), key=lambda kv: (kv[0] == "default", kv[0])))
    out["security"] = [{"bearer": []}, {}] if op.auth else []
    return out


def documented(routes: Sequence[BaseRoute]) -> list[tuple[str, str]]:
    """(path, method) of every operation ``routes`` serve; HEAD (Starlette adds it to GET) is left out."""
    found: list[tuple[str, str]] = []
    for route in routes:
        if not isinstance(route, Route):
            raise TypeError(f"the OpenAPI document knows plain routes only, not {route!r}")
        found += [(route.path_format, m.lower()) for m in sorted(route.methods or ()) if m != "HEAD"]
    return found


def document(routes: Sequence[BaseRoute]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (an app's ``app.routes``)."""
    ops = _operations()
    schemas = _Schemas()
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route):
            raise TypeError(f"the OpenAPI document knows plain routes only, not {route!r}")
        op = ops.get(_key(route.endpoint))
        if op is None:
            raise LookupError(f"{route.path} is served by {_key(route.endpoint)}, which has no Op in {__name__}")
        for path, method in documented([route]):
            paths.setdefault(path, {})[method] = _operation(path, method, op, schemas)
    doc = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "lmspd",
            "version": __version__,
            "summary": "A local MLX model server: the OpenAI Responses API and LMSP durable tasks",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "tags": [
            {"name": "lmsp", "description": "LMSP durable tasks and discovery; errors are RFC 9457 problem objects"},
            {"name": "responses", "description": "OpenAI Responses API; errors in OpenAI's envelope"},
            {"name": "chat", "description": "OpenAI Chat Completions, a view on the same durable core"},
            {"name": "models", "description": "OpenAI model list"},
            {"name": "health", "description": "Liveness and readiness, no token"},
            {"name": "meta", "description": "This document"},
        ],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "required when the server is configured with tokens (server.tokens, LMSP_API_KEYS)",
                }
            },
        },
    }
    return schemas.resolve(doc)
