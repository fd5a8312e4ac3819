"""Errors as HTTP responses: problem objects on /lmsp/v1 (docs/lmsp.md §9.3), OpenAI's envelope on /v1,
Anthropic's on the Messages API (docs/messages.md, "Errors").

Both are rendered from the error's class (``lmspd.errors``): its code, status
and title; nothing here knows individual errors.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from lmspd.errors import LmspdError
from lmspd.messages.view import error_body


class OpenAIErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    error: OpenAIErrorBody


def is_openai_path(path: str) -> bool:
    """Whether ``path`` answers errors in OpenAI's envelope (/v1 and its aliases) rather than
    as problem objects (/lmsp/v1, health)."""
    return path.startswith(("/v1/", "/responses", "/chat/"))


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is the Messages API's (with or without /v1), which answers errors in
    Anthropic's envelope."""
    return path.startswith(("/v1/messages", "/messages")) and path.removeprefix("/v1")[9:10] in ("", "/")


def _headers(status: int) -> dict[str, str]:
    if status in (429, 503, 529):
        return {"Retry-After": "1"}
    if status == 401:
        return {"WWW-Authenticate": "Bearer"}
    return {}


def problem_response(exc: LmspdError) -> Response:
    return Response(
        msgspec.json.encode(exc.problem()),
        status_code=exc.status,
        media_type="application/problem+json",
        headers=_headers(exc.status),
    )


def openai_body(exc: LmspdError) -> OpenAIError:
    return OpenAIError(
        OpenAIErrorBody(message=exc.message, type=exc.openai_type, param=exc.param, code=exc.openai_code)
    )


def _envelope(body: object, status: int) -> Response:
    return Response(
        msgspec.json.encode(body), status_code=status, media_type="application/json", headers=_headers(status)
    )


def openai_response(exc: LmspdError) -> Response:
    return _envelope(openai_body(exc), exc.openai_http_status)


def anthropic_response(exc: LmspdError) -> Response:
    return _envelope(error_body(exc), exc.anthropic_http_status)


def error_response(path: str, exc: LmspdError) -> Response:
    """``exc`` in the shape of the surface ``path`` belongs to: Anthropic's envelope on the
    Messages routes, OpenAI's on the rest of /v1, a problem object on /lmsp/v1 and health."""
    if is_anthropic_path(path):
        return anthropic_response(exc)
    return openai_response(exc) if is_openai_path(path) else problem_response(exc)
