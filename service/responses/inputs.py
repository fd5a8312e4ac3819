"""Input items of a Responses request, and their rendering into chat messages.

An item with a ``role`` and no ``type`` is a message; assistant messages accept
``output_text`` and ``refusal`` parts, so a client can send a previous
``response.output`` straight back as input.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from service.errors import InvalidRequestError


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


class FunctionCallOutputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
_LATER = {"reasoning", "compaction", "input_image", "input_file", "input_audio"}


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
    if ptype in _LATER:
        raise InvalidRequestError(f"{param}: content type '{ptype}' is not supported", param=f"{param}.type")
    raise InvalidRequestError(f"{param}: unknown content type {ptype!r}", param=f"{param}.type")


def parse_items(raw: list[Any], param: str = "input") -> list[Item]:
    items: list[Item] = []
    for i, obj in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(obj, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        itype = obj.get("type", "message" if "role" in obj else None)
        item: Item
        if itype == "message":
            message: MessageItem = _convert(obj, MessageItem, where)
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    _part_text(part, f"{where}.content[{j}]")
            item = message
        elif itype == "function_call":
            item = _convert(obj, FunctionCallItem, where)
        elif itype == "function_call_output":
            item = _convert(obj, FunctionCallOutputItem, where)
        elif itype in _LATER:
            raise InvalidRequestError(f"{where}: item type '{itype}' is not supported yet", param=f"{where}.type")
        else:
            raise InvalidRequestError(f"{where}: unknown item type {itype!r}", param=f"{where}.type")
        items.append(item)
    return items


def to_messages(items: list[Item]) -> list[dict[str, Any]]:
    """Chat-template messages; function calls travel as the assistant's tool_calls."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            text = (
                item.content if isinstance(item.content, str) else "".join(_part_text(p, "input") for p in item.content)
            )
            out.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"name": item.name, "arguments": item.arguments}
            out.append(
                {
                    "role": "assistant",
                    "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
                    "tool_calls": [{"id": item.call_id, "type": "function", "function": call}],
                }
            )
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out
