"""The one exception tree of lmspd.

Every error the service raises on purpose derives from :class:`LmspdError` and
carries a stable ``code`` (the LMSP problem code) and, where one field is to
blame, ``param``.
"""

from __future__ import annotations


class LmspdError(Exception):
    code = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(LmspdError):
    code = "invalid_config"


class ModelError(LmspdError):
    code = "model_error"


class ModelNotFoundError(ModelError):
    code = "model_not_found"


class ModelConversionError(ModelError):
    code = "model_conversion_failed"


class ModelDownloadError(ModelError):
    code = "model_download_failed"


class InvalidRequestError(LmspdError):
    code = "invalid_request"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class EngineError(LmspdError):
    code = "engine_error"


class EngineCrashedError(EngineError):
    code = "engine_crashed"


class TaskNotFoundError(LmspdError):
    code = "task_not_found"


class TaskNotCancelableError(LmspdError):
    code = "task_not_cancelable"


class IdempotencyKeyReusedError(LmspdError):
    code = "idempotency_key_reused"


class QueueFullError(LmspdError):
    code = "rate_limit_exceeded"


class SequenceConflictError(LmspdError):
    """An event append raced another writer of the same task (a bug, never a client error)."""

    code = "server_error"
