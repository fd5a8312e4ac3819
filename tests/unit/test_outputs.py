"""Output items from generated text: reasoning, message and function calls in order, each
event valid, and a state rebuilt from the event log continuing exactly as if never stopped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from harness.openresponses import validate, validate_event
from lmspd.prompting.prompt import Prompt
from lmspd.responses import schema as s
from lmspd.responses.builder import ResponseState, initial_response
from lmspd.responses.tools import tool_options
from lmspd.store.task_store import Event, EventBuilder, TaskRecord

TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
# What a reasoning model with Hermes calls generates, cut as its tokens would be.
DELTAS = [
    "Let me",
    " think.",
    "\n</think>",
    "\n\nSure",
    ", calling it.",
    "\n<tool",
    "_call>\n{",
    '"name": "f", ',
    '"arguments": {"a": ',
    '[1, "x}"]}}\n</tool_call>',
]
REQUEST = s.ResponseRequest(input="hi", tools=TOOLS)
TASK = TaskRecord(
    id="t",
    owner="",
    type="response",
    status="running",
    on_restart="resume",
    request=b"{}",
    response_id="resp_1",
    response=None,
    error=None,
    attempt=1,
    next_seq=0,
    events_expired=0,
    created_at=1,
    updated_at=1,
    finished_at=None,
)


def prompt() -> Prompt:
    options = tool_options(TOOLS, None, None, None)
    return Prompt("", "json_tools", options, ("<think>", "</think>"), True, None, "tools")


class Log:
    """An event log as the store keeps it: numbered rows with the tokens they carry."""

    def __init__(self) -> None:
        self.rows: list[Event] = []

    def add(self, builders: list[EventBuilder]) -> None:
        for build in builders:
            new = build(TASK, len(self.rows))
            self.rows.append(Event(len(self.rows), new.type, new.data, new.tokens))

    def events(self) -> list[dict[str, Any]]:
        return [msgspec.json.decode(row.data) for row in self.rows]


def run(state: ResponseState, log: Log, deltas: list[str], first_token: int) -> None:
    for i, text in enumerate(deltas):
        log.add(state.delta(text, [first_token + i]))


def fresh() -> tuple[ResponseState, Log]:
    state = ResponseState(initial_response(REQUEST, response_id="resp_1", model="m", created_at=1))
    log = Log()
    log.add(state.created())
    log.add(state.in_progress())
    state.outputs.attach(prompt().parser(), "")
    return state, log


def test_reasoning_then_message_then_call_with_streamed_arguments() -> None:
    state, log = fresh()
    run(state, log, DELTAS, 0)
    log.add(state.finish("stop", 5))
    events = log.events()
    for event in events:
        validate_event(event)
    final = events[-1]["response"]
    validate("ResponseResource", final)
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me think.\n"
    assert final["output"][1]["content"][0]["text"] == "Sure, calling it."
    call = final["output"][2]
    assert json.loads(call["arguments"]) == {"a": [1, "x}"]} and call["status"] == "completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call["arguments"]
    # Each item is closed before the next one opens.
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [0, 1, 2]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert final["usage"]["output_tokens"] == len(DELTAS)
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3  # "Let me", " think.", "</think>"


@pytest.mark.parametrize("cut", range(1, len(DELTAS)))
def test_a_state_rebuilt_from_its_log_continues_the_same_items(cut: int) -> None:
    whole, whole_log = fresh()
    run(whole, whole_log, DELTAS, 0)
    whole_log.add(whole.finish("stop", 5))

    first, log = fresh()
    run(first, log, DELTAS[:cut], 0)
    # The restart: only the log survives (tokens held back by the parser are lost and
    # generated again); the parser catches up from the text of the tokens stored.
    state = ResponseState.from_events(log.rows)
    stored = len(state.tokens)
    state.outputs.attach(prompt().parser(), "".join(DELTAS[:stored]))
    run(state, log, DELTAS[stored:], stored)
    log.add(state.finish("stop", 5))

    ours, theirs = log.events(), whole_log.events()
    assert [e["type"] for e in ours] == [e["type"] for e in theirs]
    final, reference = ours[-1]["response"], theirs[-1]["response"]
    assert [(i["type"], i.get("arguments"), i.get("content")) for i in final["output"]] == [
        (i["type"], i.get("arguments"), i.get("content")) for i in reference["output"]
    ]
    assert final["usage"] == reference["usage"]  # reasoning tokens counted again from the log
    # Items opened before the cut keep their ids.
    before = {e["item"]["id"] for e in ours[: len(log.rows)] if e["type"] == "response.output_item.added"}
    assert before <= {item["id"] for item in final["output"]}


def test_a_forced_call_in_a_format_without_a_grammar_is_a_400(smol_dir: Path, tmp_path: Path) -> None:
    from lmspd.errors import InvalidRequestError
    from lmspd.models.tokenizer import Tokenizer
    from lmspd.prompting.prompt import build_prompt

    (tmp_path / "tokenizer.json").write_bytes((smol_dir / "tokenizer.json").read_bytes())
    config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}<|tool_call_start|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)  # a pythonic-format template: calls are parsed, not constrained
    auto = build_prompt(tok, s.ResponseRequest(input="hi", tools=TOOLS), [])
    assert auto.tool_format == "pythonic" and auto.grammar is None
    with pytest.raises(InvalidRequestError) as info:
        build_prompt(tok, s.ResponseRequest(input="hi", tools=TOOLS, tool_choice="required"), [])
    assert info.value.param == "tool_choice"


NAMESPACED = [{"type": "namespace", "name": "ns", "description": "", "tools": TOOLS}]
NS_DELTAS = [*DELTAS[:7], '"name": "ns.f", ', *DELTAS[8:]]


def seal(item_id: str, text: str) -> str:
    return f"sealed:{item_id}:{text}"


def fresh_namespaced() -> tuple[ResponseState, Log, Prompt]:
    request = s.ResponseRequest(input="hi", tools=NAMESPACED)
    options = tool_options(NAMESPACED, None, None, None)
    prompted = Prompt("", "json_tools", options, ("<think>", "</think>"), True, None, "tools")
    state = ResponseState(initial_response(request, response_id="resp_1", model="m", created_at=1))
    log = Log()
    log.add(state.created())
    log.add(state.in_progress())
    state.outputs.attach(prompted.parser(), "", options.namespaces, seal)
    return state, log, prompted


@pytest.mark.parametrize("cut", [0, 2, 3, 5, 8, len(NS_DELTAS) - 1])
def test_namespaced_calls_and_sealed_reasoning_survive_a_rebuild(cut: int) -> None:
    """A namespaced call comes back under its own name with its namespace, and a sealed
    reasoning item keeps its seal: in the events, and after a resume rebuilt from them."""
    first, log, prompted = fresh_namespaced()
    run(first, log, NS_DELTAS[:cut], 0)
    state = ResponseState.from_events(log.rows)
    stored = len(state.tokens)
    state.outputs.attach(prompted.parser(), "".join(NS_DELTAS[:stored]), prompted.tools.namespaces, seal)
    run(state, log, NS_DELTAS[stored:], stored)
    log.add(state.finish("stop", 5))
    events = log.events()
    for event in events:
        validate_event(event)
    final = events[-1]["response"]
    reasoning, _, call = final["output"]
    assert reasoning["encrypted_content"] == seal(reasoning["id"], "Let me think.\n")
    assert (call["name"], call["namespace"]) == ("f", "ns")
    assert final["tools"][0]["type"] == "namespace"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["encrypted_content"] == reasoning["encrypted_content"] and done[2]["namespace"] == "ns"
