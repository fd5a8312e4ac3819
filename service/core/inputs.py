"""A request's input made whole at intake, before anything renders, counts or stores it
(docs/responses.md, "Coding agents"):

- ``item_reference`` items become the caller's stored items they name (opencode, the AI SDK's
  stored mode), found through the item index;
- reasoning items that carry ``encrypted_content`` get back the text sealed in it
  (lmspd.responses.sealing), so the turn renders as it was generated.

Every route that reads a request's input resolves it here (create, ``input_tokens``,
``/responses/compact``), so a reference or a seal means one thing, or is one refusal, on all of
them. The task stores the resolved input: it never depends on a response that is deleted before it
runs, and a refused reference or seal is a 400 before anything is written.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from lmspd.errors import InvalidRequestError
from lmspd.responses import schema as s
from lmspd.responses.sealing import Sealer
from lmspd.store.items import ItemIndex

R = TypeVar("R", bound=s.ResponseRequest)


def _is_reference(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    return obj.get("type") == "item_reference" or ("type" not in obj and "role" not in obj and "id" in obj)


async def _referenced(index: ItemIndex, owner: str, item_id: str, where: str) -> dict[str, Any]:
    missing = InvalidRequestError(f"{where}: item '{item_id}' not found", param=f"{where}.id")
    task = await index.task_of(owner, item_id)
    if task is None or not task.stored:
        raise missing
    if task.response:
        for item in msgspec.json.decode(task.response, type=s.Response).output:
            if item.id == item_id:
                found: dict[str, Any] = msgspec.to_builtins(item)
                return found
    sent = msgspec.json.decode(task.request, type=s.TaskRequest).input
    for obj in sent if isinstance(sent, list) else []:
        if isinstance(obj, dict) and obj.get("id") == item_id and not _is_reference(obj):
            return obj
    raise missing


def _opened(obj: dict[str, Any], sealer: Sealer, owner: str, where: str) -> dict[str, Any]:
    sealed = sealer.open(owner, obj["encrypted_content"], f"{where}.encrypted_content")
    if obj.get("id") not in (None, sealed.id):
        raise InvalidRequestError(f"{where}.id is not the id sealed in its encrypted_content", param=f"{where}.id")
    # The sealed text is the reasoning: whatever else the item says (a summary, content) is not.
    return {**obj, "content": [{"type": "reasoning_text", "text": sealed.text}]}


async def resolve(request: R, owner: str, index: ItemIndex, sealer: Sealer) -> R:
    """``request`` with its input resolved (a copy when anything changed)."""
    if isinstance(request.input, str):
        return request
    raw: list[Any] = list(request.input)
    changed = False
    for i, obj in enumerate(raw):
        if _is_reference(obj):
            raw[i], changed = await _referenced(index, owner, str(obj["id"]), f"input[{i}]"), True
    for i, obj in enumerate(raw):
        if isinstance(obj, dict) and obj.get("type") == "reasoning" and isinstance(obj.get("encrypted_content"), str):
            opened = _opened(obj, sealer, owner, f"input[{i}]")
            if opened != obj:
                raw[i], changed = opened, True
    if not changed:
        return request
    resolved = msgspec.structs.replace(request, input=raw)
    resolved.items()  # what replaced a reference or a seal parses as input too
    return resolved


def item_ids(request: s.ResponseRequest, response: s.Response) -> list[str]:
    """The ids the item index keeps for a finished stored response: the ids its input items
    were sent with, and its output items'."""
    sent = request.input if isinstance(request.input, list) else []
    ids = [o["id"] for o in sent if isinstance(o, dict) and isinstance(o.get("id"), str)]
    return ids + [item.id for item in response.output]
