"""Responses objects and events seen as Chat Completions: ``chat.completion`` and its chunks.

A chat completion is the same durable response under another shape: one choice, its
message the response's text. :func:`completion` maps a finished response;
:class:`ChunkStream` maps its event log, batch by batch, into SSE frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from lmspd.errors import error_for
from lmspd.responses import schema as s
from lmspd.store.task_store import Event

FinishReason = Literal["stop", "length", "content_filter", "tool_calls"]

# --- objects --------------------------------------------------------------------------------


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CalledFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str = ""


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    annotations: list[dict[str, Any]] = []
    # UNSET: no key when no tool was called, as OpenAI answers.
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET


class Choice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: ChatMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ChatUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = msgspec.field(default_factory=CompletionTokensDetails)


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: ChatUsage | None
    system_fingerprint: str | None = None
    service_tier: str = "default"


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: str | None = None
    service_tier: str = "default"
    # UNSET leaves the key out: OpenAI sends ``usage`` only when include_usage asks for it.
    usage: ChatUsage | msgspec.UnsetType | None = msgspec.UNSET


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str = "server_error"
    param: str | None = None
    code: str | None = None


class ChatError(msgspec.Struct):
    """OpenAI's error envelope, also what a stream sends as a data frame when it fails."""

    error: ErrorBody


# --- mapping --------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()


def finish_reason(response: s.Response) -> FinishReason:
    """``length`` when the token budget ran out; ``tool_calls`` when it ended calling
    tools; a cancelled response simply stopped."""
    if response.status == "completed" and any(isinstance(i, s.FunctionCall) for i in response.output):
        return "tool_calls"
    if response.status == "incomplete" and response.incomplete_details is not None:
        reason = response.incomplete_details.reason
        if reason == "content_filter":
            return "content_filter"
        return "length" if reason == "max_output_tokens" else "stop"
    return "stop"


def usage(response: s.Response) -> ChatUsage | None:
    u = response.usage
    if u is None:
        return None
    return ChatUsage(
        prompt_tokens=u.input_tokens,
        completion_tokens=u.output_tokens,
        total_tokens=u.total_tokens,
        prompt_tokens_details=PromptTokensDetails(u.input_tokens_details.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(u.output_tokens_details.reasoning_tokens),
    )


def logprobs(entries: list[s.LogProb]) -> ChoiceLogprobs | None:
    """Responses logprobs ({token, logprob, bytes, top_logprobs}) share Chat's shape;
    converting validates them. None when there are none (logprobs were not asked for)."""
    if not entries:
        return None
    return ChoiceLogprobs(content=msgspec.convert(msgspec.to_builtins(entries), list[TokenLogprob]))


def failure(response: s.Response) -> ChatError:
    """The frame a failed stream ends with: typed as the error its code stands for (a
    context the model could not take is the client's ``invalid_request_error``, as the same
    failure answers without streaming), with lmspd's own code."""
    err = response.error
    if err is None:
        return ChatError(ErrorBody(message=f"the response ended {response.status}", code="server_error"))
    return ChatError(ErrorBody(message=err.message, type=error_for(err.code, err.message).openai_type, code=err.code))


def completion(response: s.Response, *, completion_id: str, created: int) -> ChatCompletion:
    """A finished (completed, incomplete or cancelled) response as a chat completion.
    A failed one has no completion: answer it with :func:`failure`."""
    parts = [part for item in response.output if isinstance(item, s.OutputMessage) for part in item.content]
    calls = [
        ToolCall(id=item.call_id, function=CalledFunction(name=item.name, arguments=item.arguments))
        for item in response.output
        if isinstance(item, s.FunctionCall)
    ]
    text = "".join(p.text for p in parts)
    choice = Choice(
        message=ChatMessage(content=text if text or not calls else None, tool_calls=calls if calls else msgspec.UNSET),
        finish_reason=finish_reason(response),
        logprobs=logprobs([lp for p in parts for lp in p.logprobs]),
    )
    return ChatCompletion(
        id=completion_id, created=created, model=response.model, choices=[choice], usage=usage(response)
    )


def done() -> bytes:
    return b"data: [DONE]\n\n"


def _frame(obj: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


_HANDLED = (
    frozenset(
        {
            "response.output_text.delta",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "lmsp.attempt.restarted",
        }
    )
    | s.FINAL_EVENTS
)


class ChunkStream:
    """Stored Responses events of one response → ``chat.completion.chunk`` SSE frames.

    Feed it the event log in order, in batches of any size: the concatenated output does
    not depend on where the batches split. Events with no Chat equivalent (created,
    in_progress, item and part boundaries, and whatever later kinds the log gains) are
    skipped without decoding. After the final event everything is ignored.

    ``lmsp.attempt.restarted`` (a ``retry`` task starting over) cannot be said in Chat
    chunks, which have no way to take text back. Before any text was sent it is
    invisible: the new attempt's text simply follows. After text was sent the stream
    ends with an error frame (code ``attempt_restarted``) rather than let the client
    splice two attempts together.
    """

    def __init__(self, completion_id: str, model: str, created: int, *, include_usage: bool = False) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        self.started = False
        self.sent_text = False
        self.finished = False
        self.calls: dict[str, int] = {}  # function call item id -> tool_calls index

    def frames(self, events: Sequence[Event]) -> bytes:
        out: list[bytes] = []
        for event in events:
            if self.finished:
                break
            if not self.started:
                self.started = True
                out.append(self._chunk([ChunkChoice(delta=Delta(role="assistant", content=""))]))
            if event.type in _HANDLED:
                out.extend(self._translate(s.event_decoder.decode(event.data)))
        return b"".join(out)

    def done(self) -> bytes:
        return done()

    def cut(self, code: str, message: str) -> bytes:
        """The error frame a stream the server ends before its completion sends last
        (a shutdown, a full storage): a completion is never stored, so its client sends
        the request again."""
        self.finished = True
        kind = "overloaded" if code == "storage_full" else "server_error"
        return _frame(ChatError(ErrorBody(message=message, type=kind, code=code)))

    def _translate(self, event: s.ResponseEvent) -> list[bytes]:
        if isinstance(event, s.OutputTextDelta):
            self.sent_text = self.sent_text or bool(event.delta)
            delta = Delta(content=event.delta)
            return [self._chunk([ChunkChoice(delta=delta, logprobs=logprobs(event.logprobs))])]
        if isinstance(event, s.OutputItemAdded) and isinstance(event.item, s.FunctionCall):
            self.calls[event.item.id] = len(self.calls)
            self.sent_text = True
            call = ToolCallDelta(
                index=self.calls[event.item.id],
                id=event.item.call_id,
                type="function",
                function=CalledFunction(name=event.item.name),
            )
            return [self._chunk([ChunkChoice(delta=Delta(tool_calls=[call]))])]
        if isinstance(event, s.FunctionCallArgumentsDelta) and event.item_id in self.calls:
            call = ToolCallDelta(index=self.calls[event.item_id], function=CalledFunction(arguments=event.delta))
            return [self._chunk([ChunkChoice(delta=Delta(tool_calls=[call]))])]
        if isinstance(event, s.AttemptRestarted):
            return self._restarted(event)
        if isinstance(event, s.ResponseCompleted | s.ResponseIncomplete | s.ResponseCancelled):
            return self._final(event.response)
        if isinstance(event, s.ResponseFailed):
            self.finished = True
            return [_frame(failure(event.response))]
        return []

    def _restarted(self, event: s.AttemptRestarted) -> list[bytes]:
        if not self.sent_text:
            return []
        self.finished = True
        message = (
            f"generation restarted (attempt {event.attempt}, {event.reason}) after part of its output "
            "was streamed; a chat completion stream cannot take text back, so this one ends here"
        )
        return [_frame(ChatError(ErrorBody(message=message, code="attempt_restarted")))]

    def _final(self, response: s.Response) -> list[bytes]:
        self.finished = True
        out = [self._chunk([ChunkChoice(delta=Delta(), finish_reason=finish_reason(response))])]
        if self.include_usage:
            totals = usage(response) or ChatUsage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
            out.append(self._chunk([], totals))
        return out

    def _chunk(self, choices: list[ChunkChoice], totals: ChatUsage | None = None) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.completion_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=totals if self.include_usage else msgspec.UNSET,
        )
        return _frame(chunk)
