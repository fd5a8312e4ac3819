"""The reasoning echo: reasoning put back into assistant turns sent back without it.

With the prompt cache on, the reasoning item returned with each assistant turn is
remembered, keyed by the owner and a hash of the turn it preceded (its message text,
and each call's name, arguments and call_id). Many clients send history back by hand
and drop reasoning items; rendered without its reasoning, the turn is not the text the
model generated, and the prompt cache stops matching there. So before a request is
rendered (intake check, ``/input_tokens``, the run itself: :meth:`ReasoningEcho.restore`
for all three), every assistant turn with no reasoning before it gets the remembered
item back, and the prompt renders as it was generated.

Turns are grouped as :func:`lmspd.responses.inputs.to_messages` groups them: an
assistant message starts a turn and the function calls right after it join it (calls
with no message before them make a turn of their own); a reasoning item goes with the
next turn.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from lmspd.config import Config
from lmspd.errors import LmspdError
from lmspd.responses import schema as s
from lmspd.responses.inputs import (
    CALL_ITEMS,
    CustomToolCallItem,
    FunctionCallItem,
    Item,
    MessageItem,
    ReasoningItem,
    parse_items,
)
from lmspd.store.conn import Conn
from lmspd.store.db import Database
from lmspd.store.echo import EchoStore

R = TypeVar("R", bound=s.ResponseRequest)
log = logging.getLogger("lmspd.reasoning_echo")


@dataclass(frozen=True)
class Turn:
    start: int  # index of its first item
    end: int  # one past its last item
    reasoning: int | None  # index of the reasoning item that goes with it, if any


def _is_turn_item(item: Item) -> bool:
    return isinstance(item, CALL_ITEMS) or (isinstance(item, MessageItem) and item.role == "assistant")


def turns(items: Sequence[Item]) -> list[Turn]:
    """The assistant turns of ``items``, as ``to_messages`` renders them."""
    found: list[Turn] = []
    pending: int | None = None
    i = 0
    while i < len(items):
        item = items[i]
        if isinstance(item, ReasoningItem):
            pending = i
            i += 1
            continue
        if not _is_turn_item(item):
            i += 1
            continue
        end = i + 1
        while end < len(items) and isinstance(items[end], CALL_ITEMS):
            end += 1
        found.append(Turn(i, end, pending))
        pending = None
        i = end
    return found


def _message_text(item: MessageItem) -> str:
    if isinstance(item.content, str):
        return item.content
    return "".join(str(p.get("text", p.get("refusal", ""))) for p in item.content)


def turn_key(items: Sequence[Item]) -> str:
    """SHA-256 of a turn's canonical form: what renders it, not ids or statuses (clients
    send a message back as a string or as parts, with or without its id)."""
    canonical: list[list[str]] = []
    for item in items:
        if isinstance(item, MessageItem):
            canonical.append(["message", _message_text(item)])
        elif isinstance(item, FunctionCallItem):
            canonical.append(["function_call", item.offered_name, item.arguments, item.call_id])
        elif isinstance(item, CustomToolCallItem):
            canonical.append(["custom_tool_call", item.offered_name, item.input, item.call_id])
    return hashlib.sha256(msgspec.json.encode(canonical)).hexdigest()


def to_remember(output: Sequence[Any]) -> list[tuple[str, bytes]]:
    """(turn key, reasoning item JSON) for each reasoning item in a response's ``output``
    (builtins, as returned) that an assistant turn follows."""
    raw = msgspec.to_builtins(list(output))
    items = parse_items(raw, "output")
    return [
        (turn_key(items[t.start : t.end]), msgspec.json.encode(raw[t.reasoning]))
        for t in turns(items)
        if t.reasoning is not None
    ]


def missing(items: Sequence[Item]) -> list[tuple[int, str]]:
    """(index, turn key) of each assistant turn that has no reasoning item with it."""
    return [(t.start, turn_key(items[t.start : t.end])) for t in turns(items) if t.reasoning is None]


class ReasoningEcho:
    """The echo for one server: off (``store`` None) unless both the prompt cache and the
    echo's byte budget are on."""

    def __init__(self, store: EchoStore | None) -> None:
        self.store = store

    @classmethod
    def of(cls, config: Config, db: Database) -> ReasoningEcho:
        return cls(EchoStore(db, config.responses.reasoning_echo_max_bytes) if enabled(config) else None)

    async def restore(self, owner: str, history: list[Item], request: R) -> tuple[list[Item], R, list[str]]:
        """``history`` and ``request`` with remembered reasoning put back before each of
        their assistant turns that lacks it; and the keys used. Items restored in the
        request go into its ``input`` as the JSON they were returned as; the request is a
        copy (the stored one stays as sent)."""
        if self.store is None or (isinstance(request.input, str) and not history):
            return history, request, []
        own = request.items()
        wanted = missing([*history, *own])
        if not wanted:
            return history, request, []
        found = await self.store.lookup(owner, sorted({key for _, key in wanted}))
        hits = [(index, key) for index, key in wanted if key in found]
        if not hits:
            return history, request, []
        base = len(history)
        history = list(history)
        raw = list(request.input) if isinstance(request.input, list) else []
        for index, key in reversed(hits):  # from the end, so earlier indexes stay valid
            if index < base:
                history.insert(index, msgspec.json.decode(found[key], type=ReasoningItem))
            else:
                raw.insert(index - base, msgspec.json.decode(found[key]))
        if hits[-1][0] >= base:  # some went into the request's own input
            request = msgspec.structs.replace(request, input=raw)
        return history, request, [key for _, key in hits]

    def finish_job(self, owner: str, response: s.Response, used: Sequence[str] = ()) -> Callable[[Conn], None] | None:
        """The write for a finished response: remember its reasoning, mark ``used`` keys as
        used; to run in the transaction that finishes the task. None when there is nothing."""
        if self.store is None:
            return None
        try:
            remember = to_remember(response.output)
        except LmspdError as exc:  # an output that does not read back as input: just not echoed
            log.warning("reasoning echo: output not remembered: %s", exc.message)
            remember = []
        if not remember and not used:
            return None
        return self.store.job(owner, remember, used)


def enabled(config: Config) -> bool:
    return config.engine.prompt_cache_max_bytes > 0 and config.responses.reasoning_echo_max_bytes > 0
