"""Responses objects and events seen as the Messages API: a ``message`` and its stream events.

A message is the same durable response under another shape: reasoning items are ``thinking``
blocks (their seal the ``signature``), the message's text a ``text`` block, function calls
``tool_use`` blocks. :func:`message` maps a finished response; :class:`MessageStream` maps its
event log, batch by batch, into Messages SSE events (docs/messages.md, "Streaming").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from lmspd.errors import LmspdError, error_for
from lmspd.responses import schema as s
from lmspd.store.task_store import Event

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]

# --- objects --------------------------------------------------------------------------------


class TextContent(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ToolUseContent(msgspec.Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(msgspec.Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    signature: str


ContentBlock = TextContent | ToolUseContent | ThinkingContent


class MessageUsage(msgspec.Struct, kw_only=True):
    """``input_tokens`` are the prompt's tokens the prompt cache did not hold; those it held are
    ``cache_read_input_tokens``. Nothing is billed as written to the cache (lmspd caches every
    prompt by itself), so ``cache_creation_input_tokens`` is 0."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    service_tier: Literal["standard"] = "standard"


class MessageObject(msgspec.Struct, kw_only=True):
    """Anthropic's ``Message``."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: the rendered prompt's tokens, tools and system included."""

    input_tokens: int


class ErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class AnthropicError(msgspec.Struct, tag="error", tag_field="type"):
    """Anthropic's error envelope: an error answer's body, and a stream's ``error`` event."""

    error: ErrorDetail


def error_body(exc: LmspdError) -> AnthropicError:
    return AnthropicError(ErrorDetail(type=exc.anthropic_type, message=exc.message))


# --- stream events --------------------------------------------------------------------------


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: MessageObject


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type", kw_only=True):
    index: int
    content_block: ContentBlock


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag="signature_delta", tag_field="type"):
    signature: str


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type", kw_only=True):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class MessageDeltaBody(msgspec.Struct, kw_only=True):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class DeltaUsage(msgspec.Struct, kw_only=True):
    """Cumulative counts (the SDK's accumulator overwrites with them)."""

    output_tokens: int
    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type", kw_only=True):
    delta: MessageDeltaBody
    usage: DeltaUsage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    pass


StreamEvent = (
    MessageStart
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
    | Ping
    | AnthropicError
)


# --- mapping --------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True)
class Shape:
    """What of the request the view needs: its id and model, its ``max_tokens`` (a response cut
    short of it was cut by the context) and whether thinking is shown."""

    message_id: str
    model: str
    max_tokens: int | None = None
    display_omitted: bool = False


def message_id(response_id: str) -> str:
    return f"msg_{response_id.removeprefix('resp_')}"


def stop_reason(response: s.Response, max_tokens: int | None) -> StopReason:
    """``max_tokens`` when the client's budget ran out; ``model_context_window_exceeded`` when
    the context filled before it (the engine clamps the budget to what the context leaves);
    ``tool_use`` when it ended calling tools; ``stop_sequence`` when a stop string ended it."""
    details = response.incomplete_details
    if response.status == "incomplete" and details is not None and details.reason == "max_output_tokens":
        used = response.usage.output_tokens if response.usage is not None else 0
        return "max_tokens" if max_tokens is None or used >= max_tokens else "model_context_window_exceeded"
    if response.status == "completed" and any(isinstance(i, s.FunctionCall) for i in response.output):
        return "tool_use"
    if isinstance(response.stop_sequence, str):
        return "stop_sequence"
    return "end_turn"


def usage(response: s.Response) -> MessageUsage:
    u = response.usage
    if u is None:
        return MessageUsage(input_tokens=0, output_tokens=0)
    cached = u.input_tokens_details.cached_tokens
    return MessageUsage(
        input_tokens=u.input_tokens - cached, output_tokens=u.output_tokens, cache_read_input_tokens=cached
    )


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as its ``input`` object (a call cut short parses as far as it went: {})."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _thinking(item: s.Reasoning, shape: Shape) -> ThinkingContent:
    text = "" if shape.display_omitted else "".join(part.text for part in item.content)
    signature = item.encrypted_content if isinstance(item.encrypted_content, str) else ""
    return ThinkingContent(thinking=text, signature=signature)


def content(response: s.Response, shape: Shape) -> list[ContentBlock]:
    blocks: list[ContentBlock] = []
    for item in response.output:
        if isinstance(item, s.Reasoning):
            blocks.append(_thinking(item, shape))
        elif isinstance(item, s.OutputMessage):
            text = "".join(part.text for part in item.content)
            if text:  # Anthropic sends no empty text block
                blocks.append(TextContent(text))
        elif isinstance(item, s.FunctionCall):
            blocks.append(ToolUseContent(id=item.call_id, name=item.name, input=_arguments(item.arguments)))
    return blocks


def message(response: s.Response, shape: Shape) -> MessageObject:
    """A finished (completed, incomplete or cancelled) response as a message. A failed one has
    none: answer it with its error."""
    return MessageObject(
        id=shape.message_id,
        model=shape.model,
        content=content(response, shape),
        stop_reason=stop_reason(response, shape.max_tokens),
        stop_sequence=response.stop_sequence if isinstance(response.stop_sequence, str) else None,
        usage=usage(response),
    )


def failure(response: s.Response) -> AnthropicError:
    """The ``error`` event a failed generation's stream ends with: typed as the error its code
    stands for (a context the model could not take is the client's invalid_request_error)."""
    err = response.error
    if err is None:
        return error_body(LmspdError(f"the response ended {response.status}"))
    return error_body(error_for(err.code, err.message))


def frame(event: StreamEvent) -> bytes:
    kind = str(type(event).__struct_config__.tag)
    return b"event: %s\ndata: %s\n\n" % (kind.encode(), _encoder.encode(event))


def ping() -> bytes:
    """What a stream sends while nothing happens (a long prompt prefilling, a queue)."""
    return frame(Ping())


class MessageStream:
    """Stored Responses events of one response → Messages SSE events.

    Feed it the event log in order, in batches of any size: the output does not depend on where
    the batches split. ``message_start`` comes with the first event; each output item opens a
    content block (a text block at its first text: an empty message has none) that closes when
    the item does, a thinking block with its ``signature_delta``; the final event is
    ``message_delta`` and ``message_stop``, or an ``error`` event for a failure.

    ``lmsp.attempt.restarted`` (a ``retry`` task starting over) is invisible before anything
    was streamed; after, the stream ends with an ``error`` event, as Chat's does
    (lmspd.chat.view): a stream cannot take blocks back.
    """

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.started = self.finished = self.sent = False
        self.blocks = 0  # content blocks opened so far
        self.by_item: dict[str, int] = {}  # open reasoning or call item id -> its block index
        self.text: int | None = None  # the open text block's index

    def frames(self, events: Sequence[Event]) -> bytes:
        out: list[bytes] = []
        for event in events:
            if self.finished:
                break
            if not self.started:
                self.started = True
                out.append(self._start())
            out.extend(self._translate(s.event_decoder.decode(event.data)))
        return b"".join(out)

    def cut(self, code: str, text: str) -> bytes:
        """The ``error`` event a stream the server ends before its response sends last (a
        shutdown, a full storage): a message is never stored, so its client sends it again."""
        self.finished = True
        return frame(AnthropicError(ErrorDetail(type="overloaded_error", message=f"{text} ({code})")))

    def _start(self) -> bytes:
        empty = MessageObject(
            id=self.shape.message_id,
            model=self.shape.model,
            content=[],
            usage=MessageUsage(input_tokens=0, output_tokens=0),
        )
        return frame(MessageStart(empty))

    def _open(self, block: ContentBlock) -> tuple[int, bytes]:
        index, self.blocks, self.sent = self.blocks, self.blocks + 1, True
        return index, frame(ContentBlockStart(index=index, content_block=block))

    def _close_text(self) -> list[bytes]:
        if self.text is None:
            return []
        index, self.text = self.text, None
        return [frame(ContentBlockStop(index))]

    def _delta(self, index: int, delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta) -> bytes:
        return frame(ContentBlockDelta(index=index, delta=delta))

    def _translate(self, event: s.ResponseEvent) -> list[bytes]:
        if isinstance(event, s.OutputTextDelta):
            if not event.delta:
                return []
            out: list[bytes] = []
            if self.text is None:
                self.text, opened = self._open(TextContent(""))
                out.append(opened)
            return [*out, self._delta(self.text, TextDelta(event.delta))]
        if isinstance(event, s.OutputItemAdded) and isinstance(event.item, s.Reasoning | s.FunctionCall):
            out = self._close_text()
            block: ContentBlock
            if isinstance(event.item, s.Reasoning):
                block = ThinkingContent(thinking="", signature="")
            else:
                block = ToolUseContent(id=event.item.call_id, name=event.item.name, input={})
            self.by_item[event.item.id], opened = self._open(block)
            return [*out, opened]
        if isinstance(event, s.ReasoningTextDelta) and event.item_id in self.by_item:
            if self.shape.display_omitted or not event.delta:
                return []
            return [self._delta(self.by_item[event.item_id], ThinkingDelta(event.delta))]
        if isinstance(event, s.FunctionCallArgumentsDelta) and event.item_id in self.by_item:
            return [self._delta(self.by_item[event.item_id], InputJsonDelta(event.delta))] if event.delta else []
        if isinstance(event, s.OutputItemDone):
            return self._item_done(event.item)
        if isinstance(event, s.ContentPartDone):
            return self._close_text()
        if isinstance(event, s.AttemptRestarted):
            return self._restarted(event)
        if isinstance(event, s.ResponseCompleted | s.ResponseIncomplete | s.ResponseCancelled):
            return self._final(event.response)
        if isinstance(event, s.ResponseFailed):
            self.finished = True
            return [frame(failure(event.response))]
        return []

    def _item_done(self, item: s.OutputItem) -> list[bytes]:
        if isinstance(item, s.OutputMessage):
            return self._close_text()
        index = self.by_item.pop(item.id, None)
        if index is None:
            return []
        out: list[bytes] = []
        if isinstance(item, s.Reasoning) and isinstance(item.encrypted_content, str):
            out.append(self._delta(index, SignatureDelta(item.encrypted_content)))
        return [*out, frame(ContentBlockStop(index))]

    def _restarted(self, event: s.AttemptRestarted) -> list[bytes]:
        if not self.sent:
            return []
        self.finished = True
        text = (
            f"generation restarted (attempt {event.attempt}, {event.reason}) after part of its output "
            "was streamed; a message stream cannot take blocks back, so this one ends here"
        )
        return [frame(AnthropicError(ErrorDetail(type="api_error", message=text)))]

    def _final(self, response: s.Response) -> list[bytes]:
        self.finished = True
        out = self._close_text()
        for index in sorted(self.by_item.values()):  # a cancelled response may leave one open
            out.append(frame(ContentBlockStop(index)))
        self.by_item.clear()
        totals = usage(response)
        delta = MessageDelta(
            delta=MessageDeltaBody(
                stop_reason=stop_reason(response, self.shape.max_tokens),
                stop_sequence=response.stop_sequence if isinstance(response.stop_sequence, str) else None,
            ),
            usage=DeltaUsage(
                output_tokens=totals.output_tokens,
                input_tokens=totals.input_tokens,
                cache_read_input_tokens=totals.cache_read_input_tokens,
            ),
        )
        return [*out, frame(delta), frame(MessageStop())]
