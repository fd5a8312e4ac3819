"""The conversation a ``previous_response_id`` chain stands for, rebuilt from the task store."""

from __future__ import annotations

import msgspec

from lmspd.errors import InvalidRequestError
from lmspd.responses import schema as s
from lmspd.responses.inputs import Item, parse_items
from lmspd.store.status import TERMINAL
from lmspd.store.task_store import TaskStore

MAX_CHAIN = 256


def _turn(request_json: bytes, response_json: bytes | None) -> list[Item]:
    """A turn's input items, then its output items read back as input (as a client
    sending ``response.output`` back would)."""
    request = msgspec.json.decode(request_json, type=s.TaskRequest)
    turn = request.items()
    if response_json:
        response = msgspec.json.decode(response_json, type=s.Response)
        turn += parse_items(msgspec.to_builtins(response.output), "output")
    return turn


async def history(
    store: TaskStore,
    owner: str,
    previous_response_id: str | None,
    conversation: str | None,
    before: str | None = None,
) -> list[Item]:
    """The items before this turn: a previous_response_id chain or a conversation transcript."""
    if conversation is None:
        return await chain_messages(store, owner, previous_response_id)
    messages: list[Item] = []
    for task in await store.conversation(owner, conversation):
        if before is not None and task.id >= before:
            break
        if task.status not in TERMINAL:
            raise InvalidRequestError(
                f"conversation '{conversation}' has a response in progress ('{task.response_id}')", param="conversation"
            )
        messages += _turn(task.request, task.response)
    return messages


async def chain_messages(store: TaskStore, owner: str, previous_response_id: str | None) -> list[Item]:
    """Items of every earlier turn, oldest first: each turn's input, then its output.
    Instructions are not inherited. Unknown, unstored or unfinished responses are 400s."""
    turns: list[list[Item]] = []
    current = previous_response_id
    while current is not None:
        if len(turns) >= MAX_CHAIN:
            raise InvalidRequestError(
                f"previous_response_id chain is longer than {MAX_CHAIN}", param="previous_response_id"
            )
        task = await store.get_by_response(current, owner)
        if task is None or not task.stored:  # a task's response continues like any other
            raise InvalidRequestError(f"previous response '{current}' not found", param="previous_response_id")
        if task.status not in TERMINAL:
            raise InvalidRequestError(
                f"previous response '{current}' has not finished (status: {_status(task.status)})",
                param="previous_response_id",
            )
        turns.append(_turn(task.request, task.response))
        current = task.previous_response_id
    return [m for turn in reversed(turns) for m in turn]


def _status(task_status: str) -> str:
    return {"queued": "queued", "loading": "in_progress", "running": "in_progress", "cancelling": "in_progress"}.get(
        task_status, task_status
    )
