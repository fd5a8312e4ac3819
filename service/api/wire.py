"""Request decoding (bounded, validated, naming the bad field) and the task wire object."""

from __future__ import annotations

import hashlib
import itertools
import re
from typing import Any, Literal, TypeVar

import msgspec
from starlette.requests import Request

from lmspd.api.guard import is_json
from lmspd.engine.protocol import GroupHost, HostShare
from lmspd.errors import InvalidRequestError, PayloadTooLargeError, UnsupportedMediaTypeError
from lmspd.models.sampling import SamplingDefaults
from lmspd.store.task_store import TaskRecord

T = TypeVar("T")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_PATH = re.compile(r"at `\$\.?([^`]*)`")
# JSON's structural tokens, strings skipped whole (a bracket inside a string is text).
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:,]')
_TOO_DEEP, _SCAN_TOKENS = 256, 200_000
_ASCII_INT = re.compile(r"-?[0-9]{1,18}")
_TASK_ID = re.compile(r"task_[0-9A-HJKMNP-TV-Z]{26}")


class TaskObject(msgspec.Struct, kw_only=True):
    id: str
    object: str = "task"
    type: str
    status: str
    created_at: int
    updated_at: int
    response_id: str
    events_url: str
    on_restart: str
    attempt: int
    response: msgspec.Raw | None
    error: msgspec.Raw | None


class TaskList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[TaskObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class Health(msgspec.Struct, omit_defaults=True):
    """``/healthz`` (always ``ok``) and ``/readyz`` (``ready``, or ``not_ready`` with a 503 and
    the ``reason``: shutting down, the engine down, or the default model unable to load; ready
    with a ``reason`` when an engine configured for a group of hosts serves alone)."""

    status: Literal["ok", "ready", "not_ready"]
    reason: str | None = None


class CapabilityFlags(msgspec.Struct, kw_only=True):
    event_resume: bool
    resume_snapshots: bool
    idempotency: bool
    tasks: bool


class Limits(msgspec.Struct, kw_only=True):
    max_body_bytes: int
    max_queued_tasks: int
    max_concurrency: int
    event_retention_secs: int
    task_retention_secs: int
    idempotency_key_retention_secs: int


class Capabilities(msgspec.Struct, kw_only=True):
    """``GET /lmsp/v1/capabilities`` (docs/lmsp.md §10)."""

    object: Literal["capabilities"] = "capabilities"
    lmsp_version: str
    capabilities: CapabilityFlags
    task_types: list[str]
    on_restart: list[str]
    limits: Limits


# What each model entry says beside OpenAI's fields: its state (docs/operations.md, "Models
# over a long life") and its sampling defaults ("Sampling defaults").
STATE_FIELDS = (
    "loaded",
    "resident_bytes",
    "weight_dtype",
    "numerics",
    "running",
    "last_used_at",
    "unload_at",
    "keep_alive_secs",
    "pinned",
    "sampling_defaults",
    "hosts",
)


class LmspModel(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "lmspd"
    ready: bool
    loaded: bool = False
    resident_bytes: int = 0  # its weights as the engine holds them (per weight_dtype)
    weight_dtype: str | None = None
    numerics: str | None = None  # its products': "exact" or "fast" (docs/numerics.md)
    running: int = 0  # requests generating on it
    last_used_at: int | None = None  # unix seconds its last request ended (now while in use)
    unload_at: int | None = None  # unix seconds it is unloaded if still idle (None: not due)
    keep_alive_secs: float = 0.0
    pinned: bool = False  # never unloaded for being idle
    sampling_defaults: SamplingDefaults | None = None  # what a request naming none samples with
    hosts: list[HostShare] | None = None  # split over hosts: each one's part (docs/distributed.md)


class LmspModelList(msgspec.Struct, kw_only=True):
    """``GET /lmsp/v1/models``: OpenAI's model list, each saying whether it is ready to serve."""

    object: Literal["list"] = "list"
    data: list[LmspModel]


class Model(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "lmspd"
    # lmspd's state of it, as on /lmsp/v1/models (OpenAI's clients ignore extra fields).
    loaded: bool = False
    resident_bytes: int = 0
    weight_dtype: str | None = None
    numerics: str | None = None
    running: int = 0
    last_used_at: int | None = None
    unload_at: int | None = None
    keep_alive_secs: float = 0.0
    pinned: bool = False
    sampling_defaults: SamplingDefaults | None = None
    hosts: list[HostShare] | None = None


class Recycle(msgspec.Struct, kw_only=True):
    """``POST /lmsp/v1/engine/recycle``: whether this call started a recycle (false: one was
    under way already)."""

    started: bool


class TaskCounts(msgspec.Struct, kw_only=True):
    """The caller's tasks by status (every status, zeros included)."""

    queued: int = 0
    loading: int = 0
    running: int = 0
    cancelling: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0


class EngineSummary(msgspec.Struct, kw_only=True):
    state: Literal["up", "down", "recycling"]
    pid: int | None = None
    rss_bytes: int | None = None  # the engine process's resident set (None while it is down)
    in_flight: int = 0  # the caller's own generations running on it (never another token's)
    uptime_secs: float = 0.0  # since the current engine started
    hosts: list[GroupHost] | None = None  # its group of hosts, rank 0 first (None: one process)


class Speed(msgspec.Struct, kw_only=True):
    """The last generations' speed (the server's, whoever asked for them)."""

    generations: int  # how many the figures describe (at most 32)
    ttft_ms: float | None = None  # their median time to first token (prefill; not the queue)
    tokens_per_sec: float | None = None  # tokens after the first, over the time they took


class Summary(msgspec.Struct, kw_only=True):
    """``GET /lmsp/v1/summary``: what the console's server page shows, in one read."""

    object: Literal["summary"] = "summary"
    version: str
    now: int  # unix seconds on the server: models' ``unload_at`` count down from it
    ready: bool  # as /readyz: accepting work, the engine up and the default model able to load
    tasks: TaskCounts  # the caller's own tasks only
    models: list[LmspModel]
    engine: EngineSummary
    speed: Speed


class ModelList(msgspec.Struct, kw_only=True):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[Model]


class DeletedResponse(msgspec.Struct, kw_only=True):
    """``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool


class InputTokens(msgspec.Struct, kw_only=True):
    """``POST /v1/responses/input_tokens``."""

    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


def task_object(task: TaskRecord) -> TaskObject:
    return TaskObject(
        id=task.id,
        type=task.type,
        status=task.status,
        created_at=task.created_at,
        updated_at=task.updated_at,
        response_id=task.response_id,
        events_url=f"/lmsp/v1/tasks/{task.id}/events",
        on_restart=task.on_restart,
        attempt=task.attempt,
        response=msgspec.Raw(task.response) if task.response and task.status == "succeeded" else None,
        error=msgspec.Raw(task.error) if task.error and task.status == "failed" else None,
    )


def etag(task: TaskRecord) -> str:
    digest = hashlib.sha256(f"{task.id}/{task.status}/{task.updated_at}/{task.next_seq}".encode()).hexdigest()
    return f'"{digest[:32]}"'


def ascii_int(raw: str, param: str, low: int, high: int) -> int:
    """An integer a client wrote in a query or header: ASCII digits (and a leading ``-``)
    only. Python's ``int()`` also takes ``+3``, ``1_0``, spaces and any Unicode digit."""
    if not _ASCII_INT.fullmatch(raw):
        raise InvalidRequestError(f"{param} must be an integer from {low} to {high}, got {raw!r}", param=param)
    value = int(raw)
    if not low <= value <= high:
        raise InvalidRequestError(f"{param} must be an integer from {low} to {high}, got {raw!r}", param=param)
    return value


def task_cursor(raw: str | None) -> str | None:
    """A task list's ``after``: a task id (one no longer there still marks a place)."""
    if raw is not None and not _TASK_ID.fullmatch(raw):
        raise InvalidRequestError(f"after must be a task id, got {raw!r}", param="after")
    return raw


def _require_json(request: Request) -> None:
    """A body must say it is JSON: a form or text body, or one that declares nothing (a
    page's ``no-cors`` fetch of a Blob), is refused rather than read as what it does not
    claim to be (OpenAI answers 415; docs/operations.md, "Security")."""
    declared = request.headers.get("content-type")
    if declared is None or not is_json(declared):
        shown = repr(declared) if declared is not None else "none"
        raise UnsupportedMediaTypeError(
            f"Content-Type {shown} is not supported: send application/json", param="Content-Type"
        )


async def read_body(request: Request, limit: int) -> bytes:
    _require_json(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"the body is larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"the body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def decode(body: bytes, kind: type[T]) -> T:
    """Decode and validate; the error names the offending field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(str(exc), param=_param(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"malformed JSON: {exc}") from exc
    except RecursionError:  # msgspec's bound, about 1,000 levels into an untyped field
        where = _deepest_field(body)
        raise InvalidRequestError(f"{where or 'the body'} is nested too deeply", param=where) from None


def _deepest_field(body: bytes) -> str | None:
    """The field nested too deeply: its object keys, down to its first array. Only on the
    error path, and bounded: it walks the tokens in Python, on the event loop."""
    keys: list[str | None] = []  # per open container: its current key (None: an array)
    expecting_key = False
    for m in itertools.islice(_TOKENS.finditer(body), _SCAN_TOKENS):
        token = m.group()
        if token in (b"{", b"["):
            if len(keys) >= _TOO_DEEP:
                break
            keys.append("" if token == b"{" else None)
            expecting_key = token == b"{"
        elif token in (b"}", b"]"):
            if keys:
                keys.pop()
        elif token == b",":
            expecting_key = bool(keys) and keys[-1] is not None
        elif token == b":":
            expecting_key = False
        elif expecting_key and keys:
            try:
                keys[-1] = msgspec.json.decode(token, type=str)
            except msgspec.DecodeError:
                keys[-1] = "?"
    # Where the walk stopped: at the deep value, or (past its bound) in the bulk before it.
    path = [k for k in itertools.takewhile(lambda key: key is not None, keys) if k]
    return ".".join(path[:3]) or None  # a field's name, not the whole descent


def _param(message: str) -> str | None:
    path = m.group(1) if (m := _PATH.search(message)) else ""
    if u := _UNKNOWN.search(message):
        return f"{path}.{u.group(1)}" if path else u.group(1)
    return path or None


def fingerprint(body: bytes) -> str:
    """SHA-256 of the canonical JSON (sorted keys, no whitespace) of a request body."""
    canonical: Any = msgspec.json.decode(body)
    return hashlib.sha256(msgspec.json.encode(canonical, order="sorted")).hexdigest()


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not 1 <= len(key) <= 255 or not all(0x20 <= ord(c) <= 0x7E for c in key):
        raise InvalidRequestError("Idempotency-Key must be 1-255 printable ASCII characters", param="Idempotency-Key")
    return key
