"""Input items of a Responses request, and their rendering into chat messages.

An item with a ``role`` and no ``type`` is a message; assistant messages accept
``output_text`` and ``refusal`` parts, so a client can send a previous
``response.output`` straight back as input.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from lmspd.errors import InvalidRequestError
from lmspd.responses.tools import qualified


class TextPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class RefusalPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["refusal"]
    refusal: str


class MessageItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # OpenAI's assistant message phase; carried by SDK output items


class FunctionCallItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None

    @property
    def offered_name(self) -> str:
        """The name the model called it by (a namespaced function's is qualified)."""
        return qualified(self.name, self.namespace)


class FunctionCallOutputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class CustomToolCallItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A custom (freeform) tool's call, its ``input`` raw text (a ``custom_tool_call`` output item)."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None

    @property
    def offered_name(self) -> str:
        return qualified(self.name, self.namespace)


class CustomToolCallOutputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A custom tool call's result: text, or text parts (as OpenAI allows; media is refused)."""

    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(_part_text(p, "output") for p in self.output)


class ReasoningItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A reasoning item sent back: its text (``content``, else ``summary``) is rendered
    as the next assistant turn's reasoning."""

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        parts = self.content or self.summary
        return "\n".join(str(p.get("text", "")) for p in parts)


class CompactionItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A ``compaction`` item (from ``/v1/responses/compact`` or ``context_management``): its
    ``encrypted_content`` is base64url JSON ``{"summary": str, "items": [input items]}``, not
    encrypted. It stands for every earlier item but the system and developer messages."""

    type: Literal["compaction"]
    encrypted_content: str
    id: str | None = None
    created_by: str | None = None

    def payload(self) -> tuple[str, list[Item]]:
        """The summary and the preserved items (checked when the item was parsed)."""
        return decode_payload(self.encrypted_content, "encrypted_content")


class ItemReference(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``{"type": "item_reference", "id"}`` (``type`` may be left out): an item of the caller's
    stored responses, by id. Replaced by that item at intake (lmspd.core.inputs), so nothing
    after intake sees one."""

    id: str
    type: Literal["item_reference"] | None = "item_reference"


Item = (
    MessageItem
    | FunctionCallItem
    | FunctionCallOutputItem
    | CustomToolCallItem
    | CustomToolCallOutputItem
    | ReasoningItem
    | CompactionItem
    | ItemReference
)
# A call of the assistant's turn, and what answers one (function and custom tools alike).
CALL_ITEMS = (FunctionCallItem, CustomToolCallItem)
RESULT_ITEMS = (FunctionCallOutputItem, CustomToolCallOutputItem)
_MEDIA = {"input_image", "input_file", "input_audio"}  # text models only


class _Payload(msgspec.Struct, forbid_unknown_fields=True):
    summary: str
    items: list[Any]


def encode_payload(summary: str, items: list[Item]) -> str:
    """base64url (unpadded) JSON of the summary and the preserved items as input items."""
    raw = {"summary": summary, "items": [item_json(i) for i in items]}
    return base64.urlsafe_b64encode(msgspec.json.encode(raw)).decode().rstrip("=")


def decode_payload(content: str, param: str) -> tuple[str, list[Item]]:
    """The inverse of :func:`encode_payload`; any malformation is a 400 naming ``param``."""
    try:
        raw = base64.urlsafe_b64decode(content + "=" * (-len(content) % 4))
        payload = msgspec.json.decode(raw, type=_Payload)
        items = parse_items(payload.items, f"{param}.items")
    except (binascii.Error, ValueError, msgspec.DecodeError, InvalidRequestError) as exc:
        detail = exc.message if isinstance(exc, InvalidRequestError) else str(exc)
        raise InvalidRequestError(f"{param} is not a compaction payload: {detail}", param=param) from None
    if any(isinstance(i, CompactionItem) for i in items):
        raise InvalidRequestError(f"{param}: a compaction payload cannot hold a compaction item", param=param)
    for j, item in enumerate(items):
        # Intake resolves the references of the input, not those inside a payload: lmspd never
        # writes one there (it preserves the items themselves), so one is refused, not rendered.
        if isinstance(item, ItemReference):
            raise InvalidRequestError(
                f"{param}.items[{j}] is an item reference: a compaction payload holds the items themselves",
                param=param,
            )
    return payload.summary, items


def item_json(item: Item) -> dict[str, Any]:
    """An item as input-item JSON, without the fields it does not set."""
    return {k: v for k, v in msgspec.to_builtins(item).items() if v is not None}


def _convert(obj: Any, kind: type[Any], param: str) -> Any:
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from exc


def _part_text(part: dict[str, Any], param: str) -> str:
    ptype = part.get("type")
    if ptype in ("input_text", "output_text"):
        return str(_convert(part, TextPart, param).text)
    if ptype == "refusal":
        return str(_convert(part, RefusalPart, param).refusal)
    # A list or an object is no type (and unhashable): an unknown one, below.
    if isinstance(ptype, str) and ptype in _MEDIA:
        raise InvalidRequestError(
            f"{param}: content type '{ptype}' is not supported: lmspd serves text models", param=f"{param}.type"
        )
    raise InvalidRequestError(f"{param}: unknown content type {ptype!r}", param=f"{param}.type")


def parse_items(raw: list[Any], param: str = "input") -> list[Item]:
    items: list[Item] = []
    for i, obj in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(obj, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        itype = obj.get("type", "message" if "role" in obj else "item_reference" if "id" in obj else None)
        item: Item
        if itype == "item_reference":
            item = _convert(obj, ItemReference, where)
        elif itype == "message":
            message: MessageItem = _convert(obj, MessageItem, where)
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    _part_text(part, f"{where}.content[{j}]")
            item = message
        elif itype == "function_call":
            item = _convert(obj, FunctionCallItem, where)
        elif itype == "function_call_output":
            item = _convert(obj, FunctionCallOutputItem, where)
        elif itype == "custom_tool_call":
            item = _convert(obj, CustomToolCallItem, where)
        elif itype == "custom_tool_call_output":
            result: CustomToolCallOutputItem = _convert(obj, CustomToolCallOutputItem, where)
            if isinstance(result.output, list):
                for j, part in enumerate(result.output):
                    _part_text(part, f"{where}.output[{j}]")
            item = result
        elif itype == "reasoning":
            item = _convert(obj, ReasoningItem, where)
        elif itype == "compaction":
            compacted: CompactionItem = _convert(obj, CompactionItem, where)
            decode_payload(compacted.encrypted_content, f"{where}.encrypted_content")
            item = compacted
        elif isinstance(itype, str) and itype in _MEDIA:  # a list or an object is an unknown type
            raise InvalidRequestError(
                f"{where}: item type '{itype}' is not supported: lmspd serves text models", param=f"{where}.type"
            )
        else:
            raise InvalidRequestError(f"{where}: unknown item type {itype!r}", param=f"{where}.type")
        items.append(item)
    return items


def message_text(item: MessageItem) -> str:
    return item.content if isinstance(item.content, str) else "".join(_part_text(p, "input") for p in item.content)


def hermes_call(name: str, arguments: str) -> str:
    """A call in the Hermes ``<tool_call>`` format lmspd teaches templates that ignore tools."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def hermes_custom_call(name: str, text: str) -> str:
    """A custom tool's call as lmspd writes it in the Hermes family (docs/responses.md, "Custom tools")."""
    return f"<tool_call>\n{name}\n{text}</tool_call>"


def qwen3_coder_custom_call(name: str, text: str) -> str:
    """A custom tool's call in Qwen3-Coder's XML: one parameter, ``input``, its value the raw text."""
    return f"<tool_call>\n<function={name}>\n<parameter=input>\n{text}\n</parameter>\n</function>\n</tool_call>"


def result_text(item: FunctionCallOutputItem | CustomToolCallOutputItem) -> str:
    return item.output if isinstance(item, FunctionCallOutputItem) else item.text


def to_messages(
    items: list[Item],
    *,
    native_tools: bool = False,
    think: tuple[str, str] | None = None,
    custom_call: Callable[[str, str], str] = hermes_custom_call,
) -> list[dict[str, Any]]:
    """Chat-template messages.

    ``native_tools``: the template renders ``tool_calls`` and ``tool`` messages itself;
    otherwise calls and results are written out in the Hermes format it was taught.
    ``custom_call`` writes a custom tool's call in the family's syntax.
    Calls join the assistant turn before them (its text, earlier calls); a reasoning item goes with the next
    assistant turn (as ``reasoning_content``, and inline when the model has think markers
    and the template cannot place it)."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant(joins: bool) -> dict[str, Any]:
        nonlocal reasoning
        last = out[-1] if out else None
        if joins and last is not None and last["role"] == "assistant" and reasoning is None:
            return last
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
            if think is not None:
                message["content"] = f"{think[0]}\n{reasoning}\n{think[1]}\n\n"
            reasoning = None
        out.append(message)
        return message

    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text
        elif isinstance(item, MessageItem):
            if item.role == "assistant":
                message = assistant(joins=False)
                message["content"] += message_text(item)
            else:
                out.append({"role": "system" if item.role == "developer" else item.role, "content": message_text(item)})
        elif isinstance(item, FunctionCallItem):
            message = assistant(joins=True)  # a call joins the turn's text and earlier calls
            call = {"name": item.offered_name, "arguments": item.arguments}
            message.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": call})
            if not native_tools:
                message["content"] += ("\n" if message["content"] else "") + hermes_call(
                    item.offered_name, item.arguments
                )
        elif isinstance(item, CustomToolCallItem):
            # No template renders a custom call (its tool_calls are functions): the call is
            # written in the syntax the model was shown, native template or not.
            message = assistant(joins=True)
            call_text = custom_call(item.offered_name, item.input)
            message["content"] += ("\n" if message["content"] else "") + call_text
        elif isinstance(item, CompactionItem):
            raise ValueError("compaction items are expanded before rendering (compaction.expand)")
        elif isinstance(item, ItemReference):
            raise ValueError("item references are resolved at intake (lmspd.core.inputs)")
        elif native_tools:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": result_text(item)})
        else:
            response = f"<tool_response>\n{result_text(item)}\n</tool_response>"
            last = out[-1] if out else None
            if last is not None and last["role"] == "user" and last["content"].startswith("<tool_response>"):
                last["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
    return out
