"""The one exception tree of lmspd, and the problem objects built from it.

Every error the service raises on purpose derives from :class:`LmspdError` and
carries, as class attributes, a stable ``code`` (the LMSP problem code), its
HTTP ``status`` and ``title``, and how the OpenAI envelope names it; where one
field is to blame, the instance carries ``param``. The HTTP layer renders a
problem object (docs/lmsp.md §9.3) or OpenAI's ``{"error": {...}}`` from the class alone,
and a failed task's ``error`` is the same problem object.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

# OpenAI's error "type" by HTTP status (others: invalid_request_error below 500, else server_error).
OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "overloaded",
}
# Anthropic's error "type" by HTTP status (docs/messages.md, "Errors"): others are
# invalid_request_error below 500.
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
ANTHROPIC_OVERLOADED = 529


class LmspdError(Exception):
    code: ClassVar[str] = "server_error"
    status: ClassVar[int] = 500
    title: ClassVar[str] = "Internal server error"
    # OpenAI's envelope: its ``code`` for this error (None: no code), and the HTTP status
    # on /v1 where it differs from LMSP's.
    openai_code: ClassVar[str | None] = "server_error"
    openai_status: ClassVar[int | None] = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def openai_http_status(self) -> int:
        return self.openai_status or self.status

    @property
    def openai_type(self) -> str:
        status = self.openai_http_status
        return OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    @property
    def anthropic_http_status(self) -> int:
        """The status on the Messages API: what /v1 answers 503 (overloaded, a full queue) is
        Anthropic's 529; any other server error is its 500 ``api_error``."""
        status = self.openai_http_status
        if status == 503:
            return ANTHROPIC_OVERLOADED
        return 500 if status >= 500 else status

    @property
    def anthropic_type(self) -> str:
        status = self.anthropic_http_status
        return ANTHROPIC_TYPES.get(status, "invalid_request_error")

    def problem(self) -> Problem:
        return Problem(
            type=f"urn:lmsp:problem:{self.code}",
            title=self.title,
            status=self.status,
            detail=self.message,
            code=self.code,
            param=self.param,
        )


class Problem(msgspec.Struct, omit_defaults=True, kw_only=True):
    """RFC 9457 problem object (docs/lmsp.md §9.3)."""

    type: str
    title: str
    status: int
    detail: str
    code: str
    param: str | None = None
    instance: str | None = None


# --- configuration and models ---------------------------------------------------------------


class ConfigError(LmspdError):
    code = "invalid_config"
    title = "Invalid configuration"


class ModelError(LmspdError):
    """A model exists but cannot be used (its files are broken, it failed to load)."""

    code = "model_load_failed"
    title = "Model failed to load"


class ModelNotFoundError(ModelError):
    code = "model_not_found"
    status = 404
    title = "Model not found"
    openai_code = "model_not_found"


class ModelConversionError(ModelError):
    code = "model_conversion_failed"
    title = "Model conversion failed"


class ModelDownloadError(ModelError):
    code = "model_download_failed"
    title = "Model download failed"


# --- client errors --------------------------------------------------------------------------


class InvalidRequestError(LmspdError):
    code = "invalid_request"
    status = 400
    title = "Invalid request"
    openai_code: ClassVar[str | None] = None


class ModelTooLargeError(InvalidRequestError):
    """A model whose estimated memory exceeds [engine] max_memory_bytes even loaded alone."""

    code = "model_too_large"
    title = "Model too large"
    openai_code = "model_too_large"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"
    title = "Context length exceeded"
    openai_code = "context_length_exceeded"

    def __init__(
        self, message: str, *, param: str | None = None, tokens: int | None = None, maximum: int | None = None
    ) -> None:
        super().__init__(message, param=param)
        # The prompt's tokens (at least this many, when only its size was measured) and the
        # most the model takes: the Messages API says them in the form its clients parse.
        self.tokens = tokens
        self.maximum = maximum


class InvalidPromptError(InvalidRequestError):
    """The prompt could not be made (seed: a failed job's ``invalid_prompt``, e.g. automatic
    compaction refused the history)."""

    code = "invalid_prompt"
    title = "Invalid prompt"
    openai_code = "invalid_prompt"


class MethodNotAllowedError(InvalidRequestError):
    status = 405
    title = "Method not allowed"


class UnsupportedCapabilityError(InvalidRequestError):
    code = "unsupported_capability"
    title = "Unsupported capability"
    openai_code = "unsupported_capability"


class UnsupportedMediaTypeError(InvalidRequestError):
    """A body that is not JSON by its Content-Type (OpenAI's status and code)."""

    status = 415
    title = "Unsupported media type"
    openai_code = "unsupported_content_type"


class UnauthorizedError(LmspdError):
    code = "unauthorized"
    status = 401
    title = "Unauthorized"
    openai_code = "invalid_api_key"


class ForbiddenError(LmspdError):
    """A valid token without the role the call needs (an operator's, for model control)."""

    code = "forbidden"
    status = 403
    title = "Forbidden"
    openai_code = "forbidden"


class ForbiddenOriginError(ForbiddenError):
    """A browser page of another origin calling a state-changing route (docs/operations.md,
    "Security"): refused whatever token it carries."""

    code = "forbidden_origin"
    title = "Forbidden origin"
    openai_code = "forbidden_origin"


class MisdirectedRequestError(LmspdError):
    """A ``Host`` this server does not answer to: what a DNS-rebinding page sends
    (docs/operations.md, "Security")."""

    code = "misdirected_request"
    status = 421
    title = "Misdirected request"
    openai_code = "misdirected_request"


class ModelBusyError(LmspdError):
    """An unload of a model that tasks are running on (``?force=true`` cancels them)."""

    code = "model_busy"
    status = 409
    title = "Model busy"
    openai_code = "model_busy"


class NotFoundError(LmspdError):
    code = "not_found"
    status = 404
    title = "Not found"
    openai_code = "not_found"


class TaskNotFoundError(NotFoundError):
    code = "task_not_found"
    title = "Task not found"


class TaskNotCancelableError(LmspdError):
    code = "task_not_cancelable"
    status = 409
    title = "Task not cancelable"
    openai_code = "task_not_cancelable"


class EventHistoryExpiredError(LmspdError):
    code = "event_history_expired"
    status = 410
    title = "Event history expired"
    openai_code = "event_history_expired"


class PayloadTooLargeError(LmspdError):
    code = "payload_too_large"
    status = 413
    title = "Payload too large"
    openai_code = "payload_too_large"


class IdempotencyKeyReusedError(LmspdError):
    code = "idempotency_key_reused"
    status = 422
    title = "Idempotency key reused"
    openai_code = "idempotency_key_reused"


class RateLimitError(LmspdError):
    code = "rate_limit_exceeded"
    status = 429
    title = "Rate limit exceeded"
    openai_code = "rate_limit_exceeded"


class QueueFullError(RateLimitError):
    """The task queue is full: 429 on LMSP; on /v1 the seed calls it overloaded (503)."""

    title = "Too many queued tasks"
    openai_code = "server_overloaded"
    openai_status = 503


class TooManyBackgroundJobsError(RateLimitError):
    title = "Too many background responses"


class ServerOverloadedError(LmspdError):
    code = "server_overloaded"
    status = 503
    title = "Server overloaded"
    openai_code = "server_overloaded"


class StorageFullError(ServerOverloadedError):
    """The database cannot grow (its disk, or its size limit, is full): nothing was written,
    and the same request succeeds once there is room again."""

    code = "storage_full"
    title = "Storage full"


class LeaseLostError(LmspdError):
    """This node's lease on a task was taken over by another node (fencing: docs/operations.md,
    "Several nodes"): it must write nothing more into the task and stop generating it. Never a
    client's to see."""

    code = "lease_lost"
    status = 409
    title = "Lease lost"


class StoreUnavailableError(ServerOverloadedError):
    """The database server (PostgreSQL) cannot be reached: nothing was written, and the same
    request succeeds once it is back (docs/operations.md, "Several nodes")."""

    code = "store_unavailable"
    title = "Store unavailable"


# --- failures of accepted work (a failed task's error) --------------------------------------


class TaskCorruptError(LmspdError):
    """A task's stored record or event log cannot be read back: it fails, the others run."""

    code = "task_corrupt"
    title = "Stored task unreadable"


class ServerRestartedError(LmspdError):
    code = "server_restarted"
    title = "Server restarted"


class EngineError(LmspdError):
    code = "engine_error"
    title = "Engine error"


class EngineGroupError(EngineError):
    """The engine's group of hosts cannot start or go on (docs/distributed.md): names the host
    and the cause (unreachable, another lmspd or mlx, a different model file)."""


class EngineCrashedError(EngineError):
    code = "engine_crashed"
    title = "Engine crashed"


class EngineRecycledError(EngineCrashedError):
    """The engine a generation ran on was replaced while serving: its task resumes on the next."""

    code = "engine_recycled"


class SequenceConflictError(LmspdError):
    """An event append raced another writer of the same task (a bug, never a client error)."""


def _by_code() -> dict[str, type[LmspdError]]:
    found: dict[str, type[LmspdError]] = {}
    pending: list[type[LmspdError]] = [LmspdError]
    while pending:
        cls = pending.pop(0)
        found.setdefault(cls.code, cls)  # breadth first: the most general class owns a code
        pending += cls.__subclasses__()
    return found


_BY_CODE = _by_code()


def error_for(code: str, message: str, *, param: str | None = None) -> LmspdError:
    """The error a code stands for (engine replies and stored problems carry only codes)."""
    return _BY_CODE.get(code, LmspdError)(message, param=param)
