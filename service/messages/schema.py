"""A Messages request and its translation into the Responses request the core runs.

Every field and block of docs/messages.md decodes into its own Struct, unknown fields a 400
naming them. :meth:`MessagesBody.translate` then checks what decodes but cannot be honoured
(images, a ``tool_result`` answering no ``tool_use``, server tools, ...), each a 400 naming the
Messages field, and builds the :class:`~lmspd.responses.schema.TaskRequest`: the conversation
as Responses input items, tools as function tools, ``tool_choice`` as Responses' (so ``any``
and ``tool`` take the grammar path that forces calls), thinking blocks as reasoning items
sealed in their ``signature`` (opened by the core's intake as Codex's are:
lmspd.core.inputs). Fields that change nothing for a local model are accepted and dropped;
docs/messages.md lists which.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from lmspd.errors import InvalidRequestError
from lmspd.responses.schema import ENCRYPTED_REASONING, MAX_TOKENS, TaskRequest
from lmspd.responses.tools import hosted_refusal

# Claude Code's first system block names its version (docs/messages.md, "The prompt cache"): it
# changes with every release and would break the cached prefix, and says nothing to the model.
BILLING_HEADER = "x-anthropic-billing-header:"
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
MAX_STOP_SEQUENCES = 16
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_FIELD = re.compile(r"(?:unknown|missing required) field `([^`]+)`")

# --- blocks ---------------------------------------------------------------------------------


class CacheControl(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A prompt-cache breakpoint: lmspd caches every prefix by itself, so it changes nothing."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    pass


class TextBlock(_Block, tag="text"):
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # citations of documents: none here (no documents)


class ImageBlock(_Block, tag="image"):
    """Decodes so that :meth:`MessagesBody.translate` refuses it by name: no vision model."""

    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlock(_Block, tag="document"):
    """Decodes so that it is refused by name, as an image is."""

    source: dict[str, Any]
    cache_control: CacheControl | None = None
    citations: dict[str, Any] | None = None
    context: str | None = None
    title: str | None = None


class ToolReferenceBlock(_Block, tag="tool_reference"):
    """Names a ``defer_loading`` tool (Anthropic's tool search): from then on it is offered."""

    tool_name: str
    cache_control: CacheControl | None = None


ToolResultContent = TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[ToolResultContent] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


class ToolUseBlock(_Block, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ThinkingBlock(_Block, tag="thinking"):
    """The model's reasoning, as returned: its ``signature`` seals the text (the text sent
    beside it is not read: the sealed one is what was generated)."""

    thinking: str
    signature: str


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    """Reasoning sealed with nothing shown: ``data`` is a seal as ``signature`` is."""

    data: str


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | ToolReferenceBlock
)


def _tag(obj: msgspec.Struct) -> str:
    return str(type(obj).__struct_config__.tag)


class MessageOutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A system message's own ``output_config`` (Claude Code 2.1.332 sends ``{"effort": …}`` on
    its environment message for some models): accepted, changing nothing, as the top-level
    ``effort`` is."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A turn. ``system`` mid-conversation is what Claude Code sends for its environment."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    output_config: MessageOutputConfig | None = None  # a system message's only

    def blocks(self) -> list[Block]:
        return [TextBlock(text=self.content)] if isinstance(self.content, str) else list(self.content)


# --- tools, tool_choice, thinking, output and context settings ------------------------------


class Tool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A client tool (``type`` absent or ``custom``); server tools are told apart by their type
    before this decodes (:func:`server_tool_type`)."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    defer_loading: bool = False
    cache_control: CacheControl | None = None
    # Accepted, changing nothing: examples are Anthropic's prompt material, callers and eager
    # streaming its server's (arguments always stream here).
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None
    eager_input_streaming: bool | None = None


class _Choice(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_Choice, tag="auto"):
    pass


class ToolChoiceAny(_Choice, tag="any"):
    pass


class ToolChoiceTool(_Choice, tag="tool"):
    name: str


class ToolChoiceNone(msgspec.Struct, tag="none", tag_field="type", forbid_unknown_fields=True):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class _Thinking(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    pass


# "updates" (Claude Code 2.1.332 asks for it when it prints a stream, ``--output-format
# stream-json``) shows the thinking as generated here, as "summarized" does: lmspd has no
# summarizer.
Display = Literal["summarized", "omitted", "updates"]


class ThinkingEnabled(_Thinking, tag="enabled"):
    budget_tokens: int
    display: Display | None = None


class ThinkingAdaptive(_Thinking, tag="adaptive"):
    display: Display | None = None


class ThinkingDisabled(_Thinking, tag="disabled"):
    pass


class ThinkingBetweenTools(_Thinking, tag="between_tools"):
    pass


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled | ThinkingBetweenTools


class JsonOutputFormat(msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True):
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted: changes nothing
    format: JsonOutputFormat | None = None


class ThinkingTurns(msgspec.Struct, tag="thinking_turns", tag_field="type", forbid_unknown_fields=True):
    value: int


class ClearThinking(msgspec.Struct, tag="clear_thinking_20251015", tag_field="type", forbid_unknown_fields=True):
    """Keep the thinking of only the last ``value`` assistant turns that have some ("all": every one)."""

    keep: Literal["all"] | ThinkingTurns = "all"


class ClearToolUses(
    msgspec.Struct, tag="clear_tool_uses_20250919", tag_field="type", forbid_unknown_fields=True, kw_only=True
):
    """Accepted, not applied: its default trigger (100,000 input tokens) is past any local model's
    context; a prompt that outgrows the context is the clean "prompt is too long" instead."""

    trigger: dict[str, Any] | None = None
    keep: dict[str, Any] | None = None
    clear_at_least: dict[str, Any] | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class ContextManagement(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    edits: list[ClearThinking | ClearToolUses] = []


class Metadata(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    user_id: str | None = None  # accepted, never rendered (Claude Code's is a JSON string)


# --- where each piece of the core request came from -----------------------------------------


# The fields of a Responses input item, as the Messages block it came from has them.
_USE_FIELDS = {"call_id": "id", "name": "name", "arguments": "input"}
_RESULT_FIELDS = {"call_id": "tool_use_id", "output": "content"}
_THINKING_FIELDS = {"encrypted_content": "signature", "content": "thinking"}
_REDACTED_FIELDS = {"encrypted_content": "data"}


@dataclass(frozen=True)
class Origin:
    """The Messages path an input item came from, and how its fields are named there."""

    path: str
    fields: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Translation:
    """A Messages request as the core runs it, and what the view and error naming need."""

    request: TaskRequest
    items: list[Origin]  # per input item of ``request``
    tools: list[int]  # per tool of ``request``: its index in the Messages ``tools``
    omitted: list[str]  # server tool types left out (hosted_tools = "omit")
    display_omitted: bool  # thinking.display "omitted": thinking blocks carry only their signature
    max_tokens: int | None


def server_tool_type(tool: Any) -> str | None:
    """The server tool type ``tool`` declares (``web_search_20250305``, ``bash_20250124``, ...),
    or None for a client tool (``type`` absent or ``custom``)."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    return None if kind in (None, "custom") else str(kind)


def _convert(obj: Any, kind: type[Any], where: str) -> Any:
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        inner = m.group(1) if (m := _PATH.search(text)) else ""
        if u := _FIELD.search(text):
            inner = f"{inner}.{u.group(1)}" if inner else u.group(1)
        param = f"{where}.{inner}" if inner and not inner.startswith("[") else f"{where}{inner}"
        raise InvalidRequestError(f"{param}: {text}", param=param) from exc


def _refuse_media(block: Block, where: str) -> None:
    if isinstance(block, ImageBlock | DocumentBlock):
        raise InvalidRequestError(
            f"{where}: content type '{_tag(block)}' is not supported: lmspd serves text models (no vision model)",
            param=f"{where}.type",
        )


def _system_text(system: str | list[TextBlock] | None) -> str | None:
    """The system prompt as one text, without Claude Code's billing header."""
    if system is None:
        return None
    if isinstance(system, str):
        if system.startswith(BILLING_HEADER):
            system = system.partition("\n")[2]
        return system or None
    blocks = [b.text for b in system]
    if blocks and blocks[0].startswith(BILLING_HEADER):
        blocks = blocks[1:]
    return "\n\n".join(blocks) or None


# --- the request ----------------------------------------------------------------------------


class MessagesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` both take."""

    messages: list[Message]
    model: str | None = None
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    cache_control: CacheControl | None = None
    # Accepted, changing nothing: one speed, one region, no workspaces or profiles here.
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @property
    def max_tokens_asked(self) -> int | None:
        return None

    def translate(self, *, hosted_tools: Literal["refuse", "omit"] = "refuse") -> Translation:
        """Check, then translate; every refusal a 400 naming the Messages field. The core request
        is not validated yet: its ``validate()`` names its own fields, which
        :func:`lmspd.messages.params.name_messages_fields` renames with the translation."""
        if not self.messages:
            raise InvalidRequestError("messages: at least one message is required", param="messages")
        self._check_thinking()
        offered, deferred, omitted = self._tools(hosted_tools)
        items, origins, referenced = self._items()
        for name in referenced:  # tool search: a referenced deferred tool is offered from now on
            if name in deferred:
                offered.append(deferred.pop(name))
        display = self.thinking.display if isinstance(self.thinking, ThinkingEnabled | ThinkingAdaptive) else None
        request = TaskRequest(
            model=self.model,
            input=items,
            instructions=_system_text(self.system),
            store=False,
            tools=[tool for _, tool in offered] or None,
            tool_choice=self._tool_choice(),
            parallel_tool_calls=self._parallel(),
            text=self._text(),
            # Reasoning items carry their seal: it is the thinking block's signature.
            include=[ENCRYPTED_REASONING],
            chat_template_kwargs={"enable_thinking": False} if isinstance(self.thinking, ThinkingDisabled) else None,
            **self._generation(),
        )
        return Translation(
            request=request,
            items=origins,
            tools=[i for i, _ in offered],
            omitted=omitted,
            display_omitted=display == "omitted",
            max_tokens=self.max_tokens_asked,
        )

    def _generation(self) -> dict[str, Any]:
        """The fields of the core request that only a create sets (none for count_tokens)."""
        return {}

    def _check_thinking(self) -> None:
        if isinstance(self.thinking, ThinkingEnabled):
            budget = self.thinking.budget_tokens
            if budget < MIN_THINKING_BUDGET:
                raise InvalidRequestError(
                    f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET}", param="thinking.budget_tokens"
                )
            asked = self.max_tokens_asked
            if asked is not None and budget >= asked:
                raise InvalidRequestError(
                    f"thinking.budget_tokens ({budget}) must be less than max_tokens ({asked})",
                    param="thinking.budget_tokens",
                )
        for i, edit in enumerate(self.context_management.edits if self.context_management else []):
            if isinstance(edit, ClearThinking) and isinstance(edit.keep, ThinkingTurns) and edit.keep.value < 1:
                raise InvalidRequestError(
                    f"context_management.edits[{i}].keep.value must be at least 1",
                    param=f"context_management.edits[{i}].keep.value",
                )

    def _tools(
        self, hosted_tools: Literal["refuse", "omit"]
    ) -> tuple[list[tuple[int, dict[str, Any]]], dict[str, tuple[int, dict[str, Any]]], list[str]]:
        """The tools offered now (as Responses function tools, each with its index in
        ``tools``), the deferred ones by name, and the server tool types left out."""
        offered: list[tuple[int, dict[str, Any]]] = []
        deferred: dict[str, tuple[int, dict[str, Any]]] = {}
        omitted: list[str] = []
        for i, raw in enumerate(self.tools or []):
            where = f"tools[{i}]"
            if not isinstance(raw, dict):
                raise InvalidRequestError(f"{where} must be an object", param=where)
            if (kind := server_tool_type(raw)) is not None:
                if hosted_tools == "omit":
                    omitted.append(kind)
                    continue
                # The hosted-tools rule (docs/responses.md, "Coding agents"): named, and how to turn it off.
                raise hosted_refusal(kind, where)
            tool: Tool = _convert(raw, Tool, where)
            function: dict[str, Any] = {
                "type": "function",
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.input_schema,
                "strict": bool(tool.strict),  # Anthropic's tools are not strict unless they say so
            }
            if tool.defer_loading:
                deferred[tool.name] = (i, function)
            else:
                offered.append((i, function))
        return offered, deferred, omitted

    def _tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, ToolChoiceAuto):
            return None if choice is None else "auto"
        if isinstance(choice, ToolChoiceNone):
            return "none"
        if isinstance(choice, ToolChoiceAny):
            return "required"
        return {"type": "function", "name": choice.name}

    def _parallel(self) -> bool | None:
        choice = self.tool_choice
        if isinstance(choice, _Choice) and choice.disable_parallel_tool_use:
            return False
        return None

    def _text(self) -> dict[str, Any] | None:
        """``output_config.format`` as Responses' ``text.format``: always valid (a grammar)."""
        fmt = self.output_config.format if self.output_config else None
        if fmt is None:
            return None
        return {"format": {"type": "json_schema", "name": "output", "schema": fmt.schema, "strict": True}}

    def _kept_thinking(self) -> set[tuple[int, int]]:
        """(message, block) of the thinking blocks ``clear_thinking`` keeps (all by default)."""
        found = [
            (m, k)
            for m, message in enumerate(self.messages)
            if message.role == "assistant"
            for k, block in enumerate(message.blocks())
            if isinstance(block, ThinkingBlock | RedactedThinkingBlock)
        ]
        keep: int | None = None
        for edit in self.context_management.edits if self.context_management else []:
            if isinstance(edit, ClearThinking) and isinstance(edit.keep, ThinkingTurns):
                keep = edit.keep.value
        if keep is None:
            return set(found)
        turns = sorted({m for m, _ in found})[-keep:]
        return {(m, k) for m, k in found if m in turns}

    def _items(self) -> tuple[list[dict[str, Any]], list[Origin], list[str]]:
        """The conversation as Responses input items, where each came from, and the tool names
        ``tool_reference`` blocks name."""
        items: list[dict[str, Any]] = []
        origins: list[Origin] = []
        referenced: list[str] = []
        calls: set[str] = set()
        kept = self._kept_thinking()
        last = len(self.messages) - 1
        if self.messages[last].role == "assistant":
            raise InvalidRequestError(
                f"messages[{last}]: a final assistant message (prefill) is not supported: "
                "lmspd answers in a new assistant turn",
                param=f"messages[{last}].role",
            )
        for m, message in enumerate(self.messages):
            where = f"messages[{m}]"
            if message.output_config is not None and message.role != "system":
                raise InvalidRequestError(
                    f"{where}.output_config: only a system message takes an output_config",
                    param=f"{where}.output_config",
                )
            texts: list[str] = []  # consecutive text blocks: one message item
            for k, block in enumerate(message.blocks()):
                at = f"{where}.content[{k}]"
                _refuse_media(block, at)
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                    continue
                _check_role(message.role, block, at)
                _flush(items, origins, texts, message.role, where)
                if isinstance(block, ToolResultBlock):
                    if block.tool_use_id not in calls:
                        raise InvalidRequestError(
                            f"{at}.tool_use_id: {block.tool_use_id!r} answers no tool_use of an earlier "
                            "assistant message",
                            param=f"{at}.tool_use_id",
                        )
                    output, names = _result(block, at)
                    referenced += names
                    items.append({"type": "function_call_output", "call_id": block.tool_use_id, "output": output})
                    origins.append(Origin(at, _RESULT_FIELDS))
                elif isinstance(block, ToolUseBlock):
                    calls.add(block.id)
                    arguments = json.dumps(block.input, ensure_ascii=False)
                    call = {"type": "function_call", "call_id": block.id, "name": block.name, "arguments": arguments}
                    items.append(call)
                    origins.append(Origin(at, _USE_FIELDS))
                elif isinstance(block, ThinkingBlock | RedactedThinkingBlock):
                    seal = block.signature if isinstance(block, ThinkingBlock) else block.data
                    # A cleared one is an empty reasoning item, not none: the reasoning echo
                    # (lmspd.responses.reasoning_echo) would put a missing one back.
                    kept_here = (m, k) in kept
                    items.append(
                        {"type": "reasoning", "summary": []} | ({"encrypted_content": seal} if kept_here else {})
                    )
                    fields = _THINKING_FIELDS if isinstance(block, ThinkingBlock) else _REDACTED_FIELDS
                    origins.append(Origin(at, fields))
            _flush(items, origins, texts, message.role, where)
        return items, origins, referenced


def _check_role(role: str, block: Block, where: str) -> None:
    """A block only its own side sends: tool results the user's, calls and thinking the
    assistant's, and a system message text alone."""
    kind = _tag(block)
    if role == "system" or isinstance(block, ToolReferenceBlock):
        raise InvalidRequestError(f"{where}: a '{kind}' block cannot be in a {role} message", param=f"{where}.type")
    if role == "user" and not isinstance(block, ToolResultBlock):
        raise InvalidRequestError(
            f"{where}: a '{kind}' block cannot be in a user message: it is the assistant's", param=f"{where}.type"
        )
    if role == "assistant" and isinstance(block, ToolResultBlock):
        raise InvalidRequestError(
            f"{where}: a 'tool_result' block cannot be in an assistant message: it is the user's",
            param=f"{where}.type",
        )


def _flush(items: list[dict[str, Any]], origins: list[Origin], texts: list[str], role: str, where: str) -> None:
    """The text blocks gathered so far as one message item (a mid-conversation system message
    stays one: lmspd.prompting renders it, folded where the template refuses it)."""
    if texts:
        items.append({"role": role, "content": "\n\n".join(texts)})
        origins.append(Origin(where))
        texts.clear()


def _result(block: ToolResultBlock, where: str) -> tuple[str, list[str]]:
    """A tool result's text (an error says so), and the tools it references."""
    names: list[str] = []
    if isinstance(block.content, str):
        text = block.content
    else:
        texts: list[str] = []
        for j, part in enumerate(block.content):
            _refuse_media(part, f"{where}.content[{j}]")
            if isinstance(part, TextBlock):
                texts.append(part.text)
            elif isinstance(part, ToolReferenceBlock):
                names.append(part.tool_name)
        text = "\n\n".join(texts)
    return (f"Error: {text}" if block.is_error else text), names


class MessagesRequest(MessagesBody, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: "standard"

    @property
    def max_tokens_asked(self) -> int | None:
        return self.max_tokens

    def _generation(self) -> dict[str, Any]:
        if not 1 <= self.max_tokens <= MAX_TOKENS:
            # Anthropic's 0 warms its cache without an answer; lmspd's prompt cache needs no warming.
            raise InvalidRequestError(f"max_tokens must be from 1 to {MAX_TOKENS}", param="max_tokens")
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise InvalidRequestError("temperature must be from 0 to 1", param="temperature")
        stops = self.stop_sequences or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise InvalidRequestError(
                f"stop_sequences has more than {MAX_STOP_SEQUENCES} sequences", param="stop_sequences"
            )
        for i, stop in enumerate(stops):
            if not stop:
                raise InvalidRequestError("a stop sequence must not be empty", param=f"stop_sequences[{i}]")
        # A max_tokens beyond what the context leaves is clamped by the engine, not refused.
        return {
            "max_output_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": stops or None,
            "stream": self.stream,
        }


class CountTokensRequest(MessagesBody):
    """``POST /v1/messages/count_tokens``: the request without what only generation reads."""
