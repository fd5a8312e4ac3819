"""The app's OpenAPI 3.1 document, rendered from its routes and the msgspec Structs they speak.

Every route is an :class:`~lmspd.api.routing.Operation` carrying its handler's contract (an
``Op``, declared beside the route in the handler's module): its request and response bodies
(Structs, turned into JSON Schema by ``msgspec.json.schema_components``), its SSE payload if it
streams, its parameters and the errors it can answer. This module imports no handler: it renders
whatever route table it is given, and a route without a contract is an error.
Errors are rendered per path like the app renders them (``lmspd.api.problems``): Anthropic's
envelope on the Messages API, OpenAI's on the rest of /v1 and its aliases, RFC 9457 problem
objects on /lmsp/v1 and the health routes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import msgspec
from starlette.routing import BaseRoute, Route

from lmspd import __version__
from lmspd import errors as e
from lmspd.api.problems import OpenAIError, is_anthropic_path, is_openai_path
from lmspd.api.routing import Op, Operation
from lmspd.messages.view import AnthropicError
from lmspd.responses import schema as s

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{name}"
_PATH_PARAM = re.compile(r"{(\w+)}")


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


Envelope = str  # "problem" | "openai" | "anthropic"


def _envelope(path: str) -> Envelope:
    if is_anthropic_path(path):
        return "anthropic"
    return "openai" if is_openai_path(path) else "problem"


def _error_responses(errors: Iterable[type[e.LmspdError]], *, envelope: Envelope, schemas: _Schemas) -> dict[str, Any]:
    by_status: dict[int, list[type[e.LmspdError]]] = {}
    for cls in errors:
        example = cls("")  # the status follows from the class alone (an instance's property)
        status = {"openai": example.openai_http_status, "anthropic": example.anthropic_http_status}.get(
            envelope, cls.status
        )
        by_status.setdefault(status, []).append(cls)
    media, body = {
        "openai": ("application/json", OpenAIError),
        "anthropic": ("application/json", AnthropicError),
    }.get(envelope, ("application/problem+json", e.Problem))
    content = {media: {"schema": schemas.ref(body)}}
    out: dict[str, Any] = {}
    for status in sorted(by_status):
        classes = by_status[status]
        codes = [
            (cls.title, {"openai": cls.openai_code, "anthropic": cls("").anthropic_type}.get(envelope, cls.code))
            for cls in classes
        ]
        described = "; ".join(f"{title} (`{code}`)" if code else title for title, code in dict.fromkeys(codes))
        response: dict[str, Any] = {"description": described, "content": content}
        if status in (429, 503, 529):
            response["headers"] = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
        elif status == 401:
            response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        out[str(status)] = response
    out["default"] = {"description": "Internal server error (`server_error`)", "content": content}
    return out


def _events_schema(op: Op, schemas: _Schemas, *, done: bool) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 has ``schema`` describe each event of a stream): its
    ``data`` is JSON text of one of ``op.events``; OpenAI's streams end with ``data: [DONE]``
    (``done``)."""
    refs = [schemas.ref(kind) for kind in op.events]
    payload = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": refs[0] if len(refs) == 1 else {"anyOf": refs},
    }
    fields: dict[str, Any] = {
        "event": {"type": "string"},
        "data": {"anyOf": [{"const": "[DONE]"}, payload]} if done else payload,
        "retry": {"type": "integer"},
    }
    if op.lmsp_frames:
        fields["id"] = {"type": "string", "pattern": "^[0-9]+$", "description": "the event's sequence number"}
    return {"type": "object", "properties": fields}


def _guarded(method: str) -> tuple[type[e.LmspdError], ...]:
    """What lmspd.api.guard answers before any route runs: a foreign Host on every
    operation; a foreign Origin and a body that is not JSON on every one that is no read."""
    if method in ("get", "head"):
        return (e.MisdirectedRequestError,)
    return (e.MisdirectedRequestError, e.ForbiddenOriginError, e.UnsupportedMediaTypeError)


def _operation(path: str, method: str, op: Op, schemas: _Schemas) -> dict[str, Any]:
    envelope = _envelope(path)
    alias = envelope != "problem" and not path.startswith("/v1/")
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
        done = envelope == "openai" and not op.lmsp_frames
        content["text/event-stream"] = {"schema": _events_schema(op, schemas, done=done)}
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
    responses |= _error_responses((*_guarded(method), *op.errors), envelope=envelope, schemas=schemas)
    out["responses"] = dict(sorted(responses.items(), key=lambda kv: (kv[0] == "default", kv[0])))
    out["security"] = [{"bearer": []}, {"apiKey": []}, {}] if op.auth else []
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
    schemas = _Schemas()
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route):
            raise TypeError(f"the OpenAPI document knows plain routes only, not {route!r}")
        if not isinstance(route, Operation):
            raise LookupError(f"{route.path} has no OpenAPI contract: declare it as an api.routing.Operation")
        op = route.op
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
            {
                "name": "messages",
                "description": "The Anthropic Messages API, a view on the same durable core; "
                "errors in Anthropic's envelope",
            },
            {"name": "models", "description": "OpenAI model list"},
            {"name": "health", "description": "Liveness and readiness, no token"},
            {"name": "meta", "description": "This document"},
            {"name": "console", "description": "The web console's page and assets (docs/console.md), no token"},
        ],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "required when the server is configured with tokens (server.tokens, LMSP_API_KEYS)",
                },
                "apiKey": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "x-api-key",
                    "description": "the same token, as Anthropic's clients send it",
                },
            },
        },
    }
    return schemas.resolve(doc)
