"""Wire objects of the Responses API subset that tasks run: requests, responses, events.

One ``msgspec.Struct`` per wire object, shaped after the Open Responses schema
(``ResponseResource`` and its streaming events). Decoding a request validates it;
unknown fields are rejected so nothing a client sends is silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from service.errors import InvalidRequestError

# --- requests -------------------------------------------------------------------------------


class InputText(msgspec.Struct, tag="input_text", tag_field="type", forbid_unknown_fields=True):
    text: str


class OutputTextPart(msgspec.Struct, tag="output_text", tag_field="type", forbid_unknown_fields=True):
    text: str
    annotations: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] = []


class MessageInput(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | OutputTextPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The text subset of a Responses request (tools, reasoning, formats come later)."""

    model: str | None = None
    input: str | list[MessageInput]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = None  # LMSP 7.1: ignored inside a task envelope

    def validate(self) -> None:
        if isinstance(self.input, list) and not self.input:
            raise InvalidRequestError("input must not be empty", param="input")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequestError("max_output_tokens must be >= 1", param="max_output_tokens")
        if self.metadata is not None:
            if len(self.metadata) > 16:
                raise InvalidRequestError("metadata has more than 16 keys", param="metadata")
            for k, v in self.metadata.items():
                if len(k) > 64 or len(v) > 512:
                    raise InvalidRequestError(
                        "metadata keys are at most 64 and values 512 characters", param="metadata"
                    )

    def messages(self) -> list[dict[str, str]]:
        """Chat messages for the template: instructions first, as a system message."""
        out: list[dict[str, str]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
        return out


class TaskCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["response"]
    input: ResponseRequest
    on_restart: Literal["fail", "retry", "resume"] = "fail"


# --- responses ------------------------------------------------------------------------------


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] = []


class OutputMessage(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = []


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


class TextFormat(msgspec.Struct):
    type: str = "text"


class TextField(msgspec.Struct):
    format: TextFormat = msgspec.field(default_factory=TextFormat)


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
    output: list[OutputMessage] = []
    error: ResponseError | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str = "auto"
    truncation: str = "disabled"
    parallel_tool_calls: bool = True
    text: TextField = msgspec.field(default_factory=TextField)
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    temperature: float = 1.0
    reasoning: None = None
    usage: Usage | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    store: bool = True
    background: bool = True
    service_tier: str = "default"
    metadata: dict[str, str] = {}
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


# --- events (SPEC 6.3) ----------------------------------------------------------------------


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int


class ResponseCreated(_Event, tag="response.created"):
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
    item: OutputMessage


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputMessage


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
    logprobs: list[dict[str, Any]] = []


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = []


class AttemptRestarted(_Event, tag="lmsp.attempt.restarted"):
    attempt: int
    reason: str


ResponseEvent = (
    ResponseCreated
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
    | AttemptRestarted
)
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})
event_decoder = msgspec.json.Decoder(ResponseEvent)
encoder = msgspec.json.Encoder()
