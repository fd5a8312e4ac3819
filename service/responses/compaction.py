"""Compaction, the pure part: how a compaction item renders, where history may be split, and
what the summarising generation is asked.

Rendering rule (everywhere: ``input``, ``previous_response_id`` chains, conversations): at
a compaction item every earlier item that is not a system or developer message is dropped;
the item's summary takes their place, then its preserved items, then the items after it.
The summary is folded into the leading system message (see :func:`summary_block`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lmspd.errors import ContextLengthExceededError
from lmspd.responses.inputs import (
    CALL_ITEMS,
    RESULT_ITEMS,
    CompactionItem,
    CustomToolCallItem,
    FunctionCallItem,
    Item,
    MessageItem,
    ReasoningItem,
    message_text,
    result_text,
)

SUMMARY_INSTRUCTION = (
    "Summarize the conversation so far for the assistant that will continue it. Keep every fact, "
    "name, number, decision and open task it needs; leave out pleasantries. Write plain, concise text."
)
# The largest keep_tokens default, and the default's share of the context window (seed: 1/16).
MAX_DEFAULT_KEEP = 8192


def default_keep_tokens(context_length: int) -> int:
    return max(1, min(context_length // 16, MAX_DEFAULT_KEEP))


@dataclass(frozen=True)
class Expanded:
    summary: str | None  # the summary of the last compaction item, if any
    items: list[Item]  # no compaction items


def _is_system(item: Item) -> bool:
    return isinstance(item, MessageItem) and item.role in ("system", "developer")


def expand(items: list[Item]) -> Expanded:
    """Apply the rendering rule: compaction items replaced by what they stand for."""
    summary: str | None = None
    out: list[Item] = []
    for item in items:
        if isinstance(item, CompactionItem):
            summary, preserved = item.payload()
            out = [i for i in out if _is_system(i)] + preserved
        else:
            out.append(item)
    return Expanded(summary, out)


def summary_block(summary: str) -> str:
    return f"Summary of the earlier conversation:\n{summary}"


def fold_summary(system: str | None, summary: str | None) -> str | None:
    """The leading system prompt with the summary appended. Folded there rather than sent as
    a message of its own: several chat templates (Mistral's, Llama 3's) only render a system
    message that comes first and silently drop later ones, and a user/assistant pair would
    break templates that insist on alternating roles when the preserved items begin with an
    assistant turn. Every template renders a leading system message."""
    if summary is None:
        return system
    return f"{system}\n\n{summary_block(summary)}" if system else summary_block(summary)


# --- splitting --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    system: list[Item]  # kept system/developer messages, in order
    previous_summary: str | None
    summarized: list[Item]  # what the new summary replaces
    preserved: list[Item]  # kept verbatim after the compaction item


def _is_user(item: Item) -> bool:
    return isinstance(item, MessageItem) and item.role == "user"


def split_points(convo: list[Item]) -> list[int]:
    """Indices ``i`` (1..len) where ``convo[i:]`` may be preserved: before a user turn or after
    a complete tool-call batch, never with a function call on one side and its output on the other."""
    points = []
    calls: set[str] = set()
    outputs: set[str] = set()
    for i in range(1, len(convo) + 1):
        prev = convo[i - 1]
        if isinstance(prev, CALL_ITEMS):
            calls.add(prev.call_id)
        elif isinstance(prev, RESULT_ITEMS):
            outputs.add(prev.call_id)
        boundary = i == len(convo) or _is_user(convo[i]) or isinstance(prev, RESULT_ITEMS)
        if boundary and calls <= outputs:
            points.append(i)
    return points


def plan(items: list[Item], keep_tokens: int, cost: Callable[[list[Item]], int]) -> Plan:
    """Split the (expanded) history: the last user message and the most recent complete turns
    whose ``cost`` fits ``keep_tokens`` are preserved; the rest is to be summarized."""
    expanded = expand(items)
    system = [i for i in expanded.items if _is_system(i)]
    convo = [i for i in expanded.items if not _is_system(i)]
    points = split_points(convo)
    if not points:
        raise ContextLengthExceededError("the history has no point where it can be compacted", param="input")
    fitting = [i for i in points if cost(convo[i:]) <= keep_tokens]
    cut = min(fitting) if fitting else max(points)
    users = [j for j, item in enumerate(convo) if _is_user(item)]
    last_user = users[-1] if users else None
    preserved = convo[cut:]
    summarized = convo[:cut]
    if last_user is not None and last_user < cut:  # the last user message is always kept
        preserved = [convo[last_user], *preserved]
        summarized = [item for j, item in enumerate(summarized) if j != last_user]
    if not summarized and expanded.summary is None:
        raise ContextLengthExceededError(
            "compacting cannot make this history shorter: everything in it is preserved (lower keep_tokens)",
            param="input",
        )
    return Plan(system, expanded.summary, summarized, preserved)


# --- the summarising generation ---------------------------------------------------------------


def transcript(previous_summary: str | None, items: list[Item]) -> str:
    """The turns to summarize as plain text."""
    lines: list[str] = []
    if previous_summary is not None:
        lines.append(f"(Summary of what came before: {previous_summary})")
    for item in items:
        if isinstance(item, MessageItem):
            lines.append(f"{item.role.capitalize()}: {message_text(item)}")
        elif isinstance(item, FunctionCallItem):
            lines.append(f"Assistant called {item.name}({item.arguments})")
        elif isinstance(item, CustomToolCallItem):
            lines.append(f"Assistant called {item.name} with:\n{item.input}")
        elif isinstance(item, RESULT_ITEMS):
            lines.append(f"Result of the call: {result_text(item)}")
        elif isinstance(item, ReasoningItem):
            continue  # the assistant's private reasoning is not part of the record
    return "\n".join(lines)


def summary_messages(plan: Plan) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SUMMARY_INSTRUCTION},
        {"role": "user", "content": transcript(plan.previous_summary, plan.summarized)},
    ]
