"""A route and its OpenAPI contract, declared together.

Each handler module lists its routes as :class:`Operation` s: the path, the handler and the
:class:`Op` that documents it (request and response Structs, SSE payloads, parameters, the
errors it can answer). The app's route table is these lists joined (:mod:`lmspd.api.app`), and
:mod:`lmspd.api.openapi` renders the document from the table alone, so a handler without a
contract cannot be routed and the document cannot drift from the app.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from lmspd import errors as e


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


class Operation(Route):
    """A Starlette route that carries its handler's :class:`Op`."""

    def __init__(self, path: str, endpoint: Callable[[Request], Any], op: Op, method: str = "GET") -> None:
        super().__init__(path, endpoint, methods=[method])
        self.op = op


def query(name: str, schema: dict[str, Any], description: str) -> Param:
    return Param(name, "query", schema, description)


def header(name: str, description: str) -> Param:
    return Param(name, "header", {"type": "string"}, description)


# Errors that whole families of operations share.
AUTH = (e.UnauthorizedError,)
BODY = (e.InvalidRequestError, e.PayloadTooLargeError, e.UnsupportedMediaTypeError)
GENERATE = (*BODY, e.ContextLengthExceededError, e.UnsupportedCapabilityError, e.ModelNotFoundError)
INTAKE = (e.QueueFullError, e.ServerOverloadedError)

LIMIT = query("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}, "page size")
EVENTS_LMSP = (
    "LMSP event stream (LMSP 6.4): `retry: 2000`, then per event `id: <sequence number>`, "
    "`event: <type>` and `data: <JSON>` (described here), `: keep-alive` comments while idle; it "
    "ends when the task does. Resume with `Last-Event-ID` (or `?after=`): no gap, no duplicate."
)
EVENTS_OPENAI = (
    "OpenAI server-sent events: per event `event: <type>` and `data: <JSON>` (described here), then `data: [DONE]`."
)
