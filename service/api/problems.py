"""RFC 9457 problem objects for every /lmsp/v1 error (LMSP 9.3)."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from service.errors import LmspdError

STATUS = {
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "unsupported_capability": 400,
    "unauthorized": 401,
    "not_found": 404,
    "task_not_found": 404,
    "model_not_found": 404,
    "task_not_cancelable": 409,
    "event_history_expired": 410,
    "payload_too_large": 413,
    "idempotency_key_reused": 422,
    "rate_limit_exceeded": 429,
    "server_overloaded": 503,
}
TITLES = {
    "invalid_request": "Invalid request",
    "unauthorized": "Unauthorized",
    "task_not_found": "Task not found",
    "task_not_cancelable": "Task not cancelable",
    "event_history_expired": "Event history expired",
    "idempotency_key_reused": "Idempotency key reused",
    "rate_limit_exceeded": "Too many queued tasks",
    "model_not_found": "Model not found",
    "context_length_exceeded": "Context length exceeded",
    "server_restarted": "Server restarted",
    "engine_crashed": "Engine crashed",
}


class Problem(msgspec.Struct, omit_defaults=True, kw_only=True):
    type: str
    title: str
    status: int
    detail: str
    code: str
    param: str | None = None
    instance: str | None = None


def problem(code: str, detail: str, *, param: str | None = None, status: int | None = None) -> Problem:
    return Problem(
        type=f"urn:lmsp:problem:{code}",
        title=TITLES.get(code, code.replace("_", " ").capitalize()),
        status=status or STATUS.get(code, 500),
        detail=detail,
        code=code,
        param=param,
    )


def from_error(exc: LmspdError) -> Problem:
    return problem(exc.code, exc.message, param=exc.param)


def problem_response(p: Problem, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(p), status_code=p.status, media_type="application/problem+json", headers=headers
    )


# OpenAI's error "type" by HTTP status, for the /v1 surface.
_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "overloaded",
}


class OpenAIErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    error: OpenAIErrorBody


def openai_error(p: Problem, headers: dict[str, str] | None = None) -> Response:
    """OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _OPENAI_TYPES.get(p.status, "invalid_request_error" if p.status < 500 else "server_error")
    code = {"invalid_request": None, "task_not_found": "not_found"}.get(p.code, p.code)
    body = OpenAIError(OpenAIErrorBody(message=p.detail, type=kind, param=p.param, code=code))
    return Response(msgspec.json.encode(body), status_code=p.status, media_type="application/json", headers=headers)
