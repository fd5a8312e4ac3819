"""Wire objects of the Responses API subset that tasks run: requests, responses, events.

One ``msgspec.Struct`` per wire object, shaped after the Open Responses schema
(``ResponseResource`` and its streaming events). Decoding a request validates it;
unknown fields are rejected so nothing a client sends is silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from lmspd.engine.protocol import SamplingParams, TokenLogprob
from lmspd.errors import InvalidRequestError
from lmspd.models.sampling import LMSPD_DEFAULTS, SamplingDefaults
from lmspd.responses.inputs import parse_items
from lmspd.responses.tools import (
    Directives,
    JsonObjectFormat,
    NamedCustom,
    NamedFunction,
    TextFormatPlain,
    Tool,
    directives,
)

# --- requests -------------------------------------------------------------------------------


LOGPROBS = "message.output_text.logprobs"
ENCRYPTED_REASONING = "reasoning.encrypted_content"
INCLUDES = frozenset({LOGPROBS, ENCRYPTED_REASONING})
# Codex sends about 2,000 characters in 7 keys; bounded like every other store.
MAX_CLIENT_METADATA_KEYS, MAX_CLIENT_METADATA_CHARS = 64, 65536
MAX_COMPACT_THRESHOLD = 100_000_000
# A token count a client may ask for: what the engine's 32-bit counters take (a context is
# far smaller; the supervisor clamps to it).
MAX_TOKENS = 2**31 - 1


class ResponseRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A Responses request: data. Decoding validates types and rejects unknown fields; the values
    and the features not served yet are checked by :func:`lmspd.responses.checks.accept`, which
    parses its directives (:func:`directives_of`) once for intake to carry."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = None  # docs/lmsp.md §7.1: ignored inside a task envelope
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    truncation: str | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Documented by OpenAI; accepted and echoed where the response has them, as they change
    # nothing here (one service tier, no caching policy, no per-end-user accounting).
    user: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    prompt: dict[str, Any] | None = None
    # Codex's request tags (thread, turn, window ids): stored with the request, never rendered.
    client_metadata: dict[str, str] | None = None

    @property
    def sealed_reasoning(self) -> bool:
        """Reasoning items carry ``encrypted_content`` (``include: ["reasoning.encrypted_content"]``)."""
        return ENCRYPTED_REASONING in (self.include or [])

    @property
    def logprobs(self) -> int | None:
        """How many alternatives per token the client asked for; None: no logprobs."""
        if LOGPROBS not in (self.include or []):
            return None
        return self.top_logprobs or 0

    def compact_threshold(self) -> int | None:
        """``context_management``'s compaction threshold (None: no automatic compaction)."""
        if self.context_management is None:
            return None
        threshold: int | None = None
        for i, entry in enumerate(self.context_management):
            where = f"context_management[{i}]"
            if not isinstance(entry, dict) or entry.get("type") != "compaction":
                raise InvalidRequestError(f"{where}.type must be 'compaction'", param=f"{where}.type")
            if set(entry) - {"type", "compact_threshold"}:
                extra = sorted(set(entry) - {"type", "compact_threshold"})[0]
                raise InvalidRequestError(f"{where}.{extra} is not a known field", param=f"{where}.{extra}")
            value = entry.get("compact_threshold")
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COMPACT_THRESHOLD:
                raise InvalidRequestError(
                    f"{where}.compact_threshold must be an integer from 1 to {MAX_COMPACT_THRESHOLD}",
                    param=f"{where}.compact_threshold",
                )
            if threshold is not None:
                raise InvalidRequestError("context_management has more than one compaction entry", param=where)
            threshold = value
        return threshold

    def sampling(self, defaults: SamplingDefaults | None = None) -> SamplingParams:
        """The engine's sampling parameters: each one the request names, else the model's
        ``defaults`` (None: lmspd's own, OpenAI's), the one place this is decided
        (docs/operations.md, "Sampling defaults"). An explicit temperature 0 stays greedy."""
        model = defaults or LMSPD_DEFAULTS
        return SamplingParams(
            temperature=model.temperature if self.temperature is None else self.temperature,
            top_p=model.top_p if self.top_p is None else self.top_p,
            top_k=model.top_k,
            min_p=model.min_p,
        )

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, dict):
            cid = self.conversation.get("id")
            return cid if isinstance(cid, str) and cid else None
        return self.conversation or None

    def items(self) -> list[Any]:
        if isinstance(self.input, str):
            return parse_items([{"role": "user", "content": self.input}])
        return parse_items(self.input)


# The fields :func:`directives_of` reads: a copy that changes none of them has the same directives.
DIRECTIVE_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls", "max_tool_calls", "text", "reasoning"})


def directives_of(request: ResponseRequest) -> Directives:
    """tools, tool_choice, text and reasoning in their typed, checked form (their schemas are
    checked by ``enforce.check_directives``): intake parses them once (``checks.accept``) and
    carries them; a stage that reads a stored request back parses them from it."""
    return directives(
        tools=request.tools,
        tool_choice=request.tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        max_tool_calls=request.max_tool_calls,
        text=request.text,
        reasoning=request.reasoning,
    )


class TaskRequest(ResponseRequest, kw_only=True, omit_defaults=True):
    """What a task runs, as stored with it: a Responses request plus what other views
    (Chat Completions) may ask for. Clients never send this shape directly."""

    stop: list[str] | None = None
    seed: int | None = None
    # The model's sampling defaults when the task was accepted (the core's, at intake): a task
    # resumed after a restart samples as it began, whatever the model's files say by then.
    # None: not known at intake (a model only here once the task runs, or a task older than
    # them): the node that runs it reads the model's.
    sampling_defaults: SamplingDefaults | None = None
    top_k: int | None = None  # the Messages API's (docs/messages.md)

    @classmethod
    def of(cls, request: ResponseRequest, **extra: Any) -> TaskRequest:
        if isinstance(request, TaskRequest):
            return msgspec.structs.replace(request, **extra) if extra else request
        fields = {f: getattr(request, f) for f in request.__struct_fields__}
        return cls(**fields, **extra)

    def sampling(self, defaults: SamplingDefaults | None = None) -> SamplingParams:
        """As the request's, over its stored :attr:`sampling_defaults` (else ``defaults``);
        a ``top_k`` the request names (the Messages API's) wins over the model's."""
        extra: dict[str, Any] = {}
        if self.seed is not None:
            extra["seed"] = self.seed
        if self.top_k is not None:
            extra["top_k"] = self.top_k
        params = super().sampling(self.sampling_defaults or defaults)
        return msgspec.structs.replace(params, **extra) if extra else params


class CompactResponse(msgspec.Struct, kw_only=True):
    """``response.compaction``: what ``POST /v1/responses/compact`` answers (Open Responses'
    ``CompactResource``)."""

    id: str
    object: Literal["response.compaction"] = "response.compaction"
    created_at: int
    model: str
    output: list[dict[str, Any]]
    usage: Usage


class CompactRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/responses/compact`` (Open Responses ``CompactResponseMethodPublicBody``)."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int = 1024
    keep_tokens: int | None = None
    prompt_cache_key: str | None = None
    # Rejected with a 400 naming them (they are OpenAI's, but compaction here is stateless).
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    stream: bool | None = None
    # Documented by OpenAI for requests in general; they change nothing here.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None

    def validate(self) -> None:
        for name in ("stream", "previous_response_id", "conversation"):
            if getattr(self, name) not in (None, False):
                raise InvalidRequestError(
                    f"{name} is not supported by /responses/compact: send the whole history as input", param=name
                )
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequestError("input must not be empty", param="input")
        if not 1 <= self.max_output_tokens <= 16384:
            raise InvalidRequestError("max_output_tokens must be from 1 to 16384", param="max_output_tokens")
        if self.keep_tokens is not None and not 1 <= self.keep_tokens <= MAX_TOKENS:
            raise InvalidRequestError(f"keep_tokens must be from 1 to {MAX_TOKENS}", param="keep_tokens")
        self.request()  # parses the input items

    def request(self) -> ResponseRequest:
        """The history as a Responses request (rendered and counted like /input_tokens)."""
        request = ResponseRequest(model=self.model, input=self.input, instructions=self.instructions)
        request.items()
        return request


class TaskCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["response"]
    input: ResponseRequest
    on_restart: Literal["fail", "retry", "resume"] = "fail"


# --- responses ------------------------------------------------------------------------------


class TopLogProb(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class LogProb(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogProb]

    @classmethod
    def of(cls, entry: TokenLogprob) -> LogProb:
        tops = [TopLogProb(t.token, t.logprob, t.bytes) for t in entry.top_logprobs]
        return cls(entry.token, entry.logprob, entry.bytes, tops)


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[dict[str, Any]] = []
    logprobs: list[LogProb] = []


class OutputMessage(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


class FunctionCall(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True, omit_defaults=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = None  # the function's namespace tool (OpenAI's field; absent at top level)


class CustomToolCall(msgspec.Struct, tag="custom_tool_call", tag_field="type", kw_only=True, omit_defaults=True):
    """OpenAI's ``custom_tool_call``: a custom (freeform) tool called with raw text (``input``)."""

    id: str
    call_id: str
    name: str
    input: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = None  # the tool's namespace, as for a function call


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class Reasoning(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    id: str
    summary: list[dict[str, Any]] = []
    content: list[ReasoningText] = []
    # Open Responses' reasoning item has no status; OpenAI's carries one, and clients
    # echo it back as input.
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    # With include ["reasoning.encrypted_content"]: the sealed text (responses/sealing.py);
    # absent otherwise (Open Responses types it a string, never null).
    encrypted_content: str | msgspec.UnsetType = msgspec.UNSET


class Compaction(msgspec.Struct, tag="compaction", tag_field="type", kw_only=True, omit_defaults=True):
    """Open Responses ``CompactionBody``: the summary and preserved items (see inputs.CompactionItem)."""

    id: str
    encrypted_content: str
    created_by: str | None = None


OutputItem = OutputMessage | FunctionCall | CustomToolCall | Reasoning | Compaction


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str


class EchoedJsonSchema(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True, omit_defaults=False):
    """text.format as Open Responses' ``JsonSchemaResponseFormat`` echoes it: its
    ``schema`` is typed null there, so the schema itself is not repeated."""

    name: str
    description: str | None = None
    schema: None = None
    strict: bool = False


class TextField(msgspec.Struct, omit_defaults=True):
    format: TextFormatPlain | JsonObjectFormat | EchoedJsonSchema = msgspec.field(default_factory=TextFormatPlain)
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, omit_defaults=False):
    """Open Responses ``Reasoning``: the request's reasoning settings, echoed."""

    effort: str | None = None
    summary: str | None = None


ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class Response(msgspec.Struct, kw_only=True, omit_defaults=False):
    """Open Responses ``ResponseResource``: every field, always present."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    incomplete_details: IncompleteDetails | None = None
    model: str
    previous_response_id: str | None = None
    instructions: str | None = None
    output: list[OutputItem] = []
    error: ResponseError | None = None
    tools: list[Tool] = []
    tool_choice: str | NamedFunction | NamedCustom = "auto"
    truncation: str = "disabled"
    parallel_tool_calls: bool = True
    text: TextField = msgspec.field(default_factory=TextField)
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    temperature: float = 1.0
    reasoning: ReasoningConfig | None = None
    usage: Usage | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    store: bool = True
    background: bool = True
    service_tier: str = "default"
    metadata: dict[str, str] = {}
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # lmspd's: the stop string that ended the response, present only then. Only the views
    # that take stop strings (Chat Completions, Messages) can make one; Messages reports it
    # as ``stop_sequence`` (docs/messages.md).
    stop_sequence: str | msgspec.UnsetType = msgspec.UNSET


# --- events (docs/lmsp.md §6.3) -------------------------------------------------------------


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int


class ResponseCreated(_Event, tag="response.created"):
    response: Response


class ResponseQueued(_Event, tag="response.queued"):
    response: Response


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: Response


class ResponseCompleted(_Event, tag="response.completed"):
    response: Response


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: Response


class ResponseFailed(_Event, tag="response.failed"):
    response: Response


class ResponseCancelled(_Event, tag="response.cancelled"):
    response: Response


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


class CustomToolCallInputDelta(_Event, tag="response.custom_tool_call_input.delta"):
    item_id: str
    output_index: int
    delta: str


class CustomToolCallInputDone(_Event, tag="response.custom_tool_call_input.done"):
    item_id: str
    output_index: int
    input: str


class ReasoningTextDelta(_Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(_Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[LogProb] = []


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[LogProb] = []


class AttemptRestarted(_Event, tag="lmsp.attempt.restarted"):
    attempt: int
    reason: str


class CompactionStarted(_Event, tag="mlx.compaction.started"):
    response_id: str
    input_tokens: int


class CompactionCompleted(_Event, tag="mlx.compaction.completed"):
    response_id: str
    input_tokens_before: int
    input_tokens_after: int


ResponseEvent = (
    ResponseCreated
    | ResponseQueued
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | ResponseFailed
    | ResponseCancelled
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | CustomToolCallInputDelta
    | CustomToolCallInputDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | AttemptRestarted
    | CompactionStarted
    | CompactionCompleted
)


class StreamError(msgspec.Struct, tag="error", tag_field="type", kw_only=True):
    """OpenAI's ``error`` stream event: never stored, it is what a /v1 stream the server ends
    before its response (a shutdown, a full storage) says last, before ``[DONE]``. Its
    ``sequence_number`` is that of the last event sent: a resume starts after it."""

    sequence_number: int
    code: str
    message: str
    param: str | None = None


FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})
event_decoder = msgspec.json.Decoder(ResponseEvent)
encoder = msgspec.json.Encoder()
