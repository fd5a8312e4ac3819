"""``GET /v1/responses/{id}/input_items``: a response's input items as OpenAI lists them.

Items a client sent without an id get a stable one derived from the response id
and their position, so ``after`` cursors keep working across calls.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from lmspd.errors import InvalidRequestError
from lmspd.responses.inputs import (
    CompactionItem,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    MessageItem,
    ReasoningItem,
)

# OpenAI's documented ``include`` values; none changes what is listed here.
INCLUDABLE = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
    }
)


class InputItemList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def _content(item: MessageItem) -> list[dict[str, Any]]:
    if isinstance(item.content, list):
        return item.content
    kind = "output_text" if item.role == "assistant" else "input_text"
    part: dict[str, Any] = {"type": kind, "text": item.content}
    if kind == "output_text":
        part |= {"annotations": [], "logprobs": []}
    return [part]


def resource(response_id: str, index: int, item: Item) -> dict[str, Any]:
    suffix = f"{response_id.removeprefix('resp_')}_{index}"
    if isinstance(item, MessageItem):
        return {
            "id": item.id or f"msg_{suffix}",
            "type": "message",
            "role": item.role,
            "content": _content(item),
            "status": item.status or "completed",
        }
    if isinstance(item, FunctionCallItem):
        call: dict[str, Any] = {
            "id": item.id or f"fc_{suffix}",
            "type": "function_call",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
            "status": item.status or "completed",
        }
        return call | ({"namespace": item.namespace} if item.namespace else {})
    if isinstance(item, ReasoningItem):
        listed: dict[str, Any] = {"id": item.id or f"rs_{suffix}", "type": "reasoning", "summary": item.summary}
        if item.content is not None:
            listed["content"] = item.content
        return listed
    if isinstance(item, CompactionItem):
        return {"id": item.id or f"cmp_{suffix}", "type": "compaction", "encrypted_content": item.encrypted_content}
    if isinstance(item, CustomToolCallItem):
        custom: dict[str, Any] = {
            "id": item.id or f"ctc_{suffix}",
            "type": "custom_tool_call",
            "call_id": item.call_id,
            "name": item.name,
            "input": item.input,
            "status": item.status or "completed",
        }
        return custom | ({"namespace": item.namespace} if item.namespace else {})
    if isinstance(item, CustomToolCallOutputItem):
        return {
            "id": item.id or f"ctco_{suffix}",
            "type": "custom_tool_call_output",
            "call_id": item.call_id,
            "output": item.output,
            "status": item.status or "completed",
        }
    assert isinstance(item, FunctionCallOutputItem)
    return {
        "id": item.id or f"fco_{suffix}",
        "type": "function_call_output",
        "call_id": item.call_id,
        "output": item.output,
        "status": item.status or "completed",
    }


def resources(response_id: str, items: list[Item]) -> list[dict[str, Any]]:
    return [resource(response_id, i, item) for i, item in enumerate(items)]


def page(
    listed: list[dict[str, Any]], *, limit: int, order: str, after: str | None, include: list[str]
) -> InputItemList:
    """One page of ``listed`` (oldest first) per OpenAI's ``limit`` (parsed by the caller),
    ``order``, ``after``."""
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order must be 'asc' or 'desc'", param="order")
    if bad := [value for value in include if value not in INCLUDABLE]:
        raise InvalidRequestError(f"include value {bad[0]!r} is not known", param="include")
    ordered = listed if order == "asc" else listed[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidRequestError(f"item '{after}' is not an input item of this response", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return InputItemList(
        data=data,
        first_id=data[0]["id"] if data else None,
        last_id=data[-1]["id"] if data else None,
        has_more=len(ordered) > len(data),
    )
