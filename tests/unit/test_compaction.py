"""Compaction's pure rules: split points, the payload, the rendering rule (no server, no model run)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from harness.families import FAMILY_FORMAT, make_family_tokenizer
from harness.openresponses import validate
from lmspd.errors import ContextLengthExceededError, InvalidRequestError
from lmspd.models.tokenizer import Tokenizer
from lmspd.prompting.prompt import build_prompt
from lmspd.responses import compaction
from lmspd.responses import schema as s
from lmspd.responses.inputs import CompactionItem, Item, decode_payload, encode_payload, item_json, parse_items


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def call(call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def result(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "42"}


def compaction_item(summary: str, preserved: list[dict[str, Any]]) -> dict[str, Any]:
    content = encode_payload(summary, parse_items(preserved))
    return {"type": "compaction", "id": "cmp_1", "encrypted_content": content}


def words(items: list[Item]) -> int:
    """A stand-in token count: one per word of the transcript."""
    return len(compaction.transcript(None, items).split())


def test_split_points_keep_calls_with_their_outputs() -> None:
    convo = parse_items(
        [user("a"), assistant("b"), user("c"), call("1"), call("2"), result("1"), result("2"), assistant("d")]
    )
    # before "c" (2), after the complete batch (7), and the end (8); never between a call and its output.
    assert compaction.split_points(convo) == [2, 7, 8]
    pending = parse_items([user("a"), call("1"), user("b")])
    assert compaction.split_points(pending) == []  # the call never got its output


def test_plan_preserves_the_last_user_message_and_the_recent_turns_that_fit() -> None:
    items = parse_items(
        [
            {"role": "system", "content": "Be brief."},
            user("one two three"),
            assistant("four five six"),
            user("seven"),
            assistant("eight"),
        ]
    )
    plan = compaction.plan(items, keep_tokens=4, cost=words)
    assert [item_json(i)["content"] for i in plan.system] == ["Be brief."]
    assert [item_json(i)["content"] for i in plan.summarized] == ["one two three", "four five six"]
    assert [item_json(i)["content"] for i in plan.preserved] == ["seven", "eight"]
    # Nothing fits: the last user message is still kept, before the latest complete turn's tail.
    tight = compaction.plan(items, keep_tokens=0, cost=words)
    assert [item_json(i)["content"] for i in tight.preserved] == ["seven"]
    assert [item_json(i)["content"] for i in tight.summarized] == ["one two three", "four five six", "eight"]


def test_plan_refuses_when_everything_would_be_kept() -> None:
    with pytest.raises(ContextLengthExceededError):
        compaction.plan(parse_items([user("hi")]), keep_tokens=100, cost=words)


def test_payload_round_trip_and_malformed_content() -> None:
    preserved = parse_items([user("hi"), call("1"), result("1")])
    content = encode_payload("the summary", preserved)
    assert "=" not in content and "+" not in content and "/" not in content  # base64url, unpadded
    raw = json.loads(base64.urlsafe_b64decode(content + "=" * (-len(content) % 4)))
    assert raw == {"summary": "the summary", "items": [item_json(i) for i in preserved]}
    summary, items = decode_payload(content, "x")
    assert summary == "the summary" and items == preserved
    bad = [
        "%%%",
        base64.urlsafe_b64encode(b"not json").decode(),
        base64.urlsafe_b64encode(b'{"summary": 1, "items": []}').decode(),
        base64.urlsafe_b64encode(b'{"summary": "s", "items": [{"type": "nope"}]}').decode(),
    ]
    for content in bad:
        with pytest.raises(InvalidRequestError) as err:
            parse_items([user("a"), {"type": "compaction", "encrypted_content": content}])
        assert err.value.param == "input[1].encrypted_content"


def test_expand_drops_what_the_compaction_item_stands_for() -> None:
    items = parse_items(
        [
            {"role": "developer", "content": "rules"},
            user("old"),
            assistant("old answer"),
            user("kept"),  # /compact's output: preserved items before the compaction item
            compaction_item("S1", [user("kept")]),
            assistant("after"),
        ]
    )
    expanded = compaction.expand(items)
    assert expanded.summary == "S1"
    assert [item_json(i)["content"] for i in expanded.items] == ["rules", "kept", "after"]
    # A later compaction item supersedes an earlier one (its summary covers it).
    later = compaction.expand([*items, *parse_items([compaction_item("S2", [user("new")])])])
    assert later.summary == "S2"
    assert [item_json(i)["content"] for i in later.items] == ["rules", "new"]


def test_a_stored_compaction_output_item_reads_back_as_input() -> None:
    content = compaction_item("S", [user("q")])["encrypted_content"]
    response = s.Response(id="resp_1", created_at=0, status="completed", model="m")
    response.output = [s.Compaction(id="cmp_1", encrypted_content=content)]
    wire = msgspec.to_builtins(response)["output"]
    validate("CompactionBody", wire[0])
    assert wire == [{"type": "compaction", "id": "cmp_1", "encrypted_content": content}]
    (item,) = parse_items(wire, "output")  # as a previous_response_id chain reads it
    assert isinstance(item, CompactionItem) and item.payload()[0] == "S"


@pytest.mark.parametrize("family", [None, *FAMILY_FORMAT])
def test_the_summary_renders_with_every_template(tmp_path: Path, smol_dir: Path, family: str | None) -> None:
    """Folded into the leading system message, the summary survives templates that drop a
    system message that is not first (Mistral, Llama 3)."""
    path = smol_dir if family is None else make_family_tokenizer(tmp_path / family, smol_dir, family)
    tok = Tokenizer(path)
    request = s.ResponseRequest(
        input=[user("old question"), assistant("old answer"), compaction_item("SUMMARY-XYZ", [user("KEPT-Q")])],
        instructions="INSTR",
    )
    text = build_prompt(tok, request, []).text
    assert "SUMMARY-XYZ" in text and "KEPT-Q" in text and "INSTR" in text
    assert "old question" not in text and "old answer" not in text
    assert text.index("SUMMARY-XYZ") < text.index("KEPT-Q")


def test_a_committed_compaction_is_rebuilt_from_the_event_log() -> None:
    """What a resumed task reads back: the compaction is done, the item is output 0, the
    answer's items follow it."""
    from lmspd.responses.builder import ResponseState
    from lmspd.store.task_store import Event, TaskRecord

    content = compaction_item("S", [user("q")])["encrypted_content"]
    state = ResponseState(s.Response(id="resp_1", created_at=0, status="in_progress", model="m"))
    task = TaskRecord(
        id="task_1", owner="o", type="response", status="running", on_restart="resume", request=b"{}",
        response_id="resp_1", response=None, error=None, attempt=1, next_seq=0, events_expired=0,
        created_at=0, updated_at=0, finished_at=None,
    )  # fmt: skip
    builders = [*state.created(), *state.compaction_begins(50), *state.compaction_done("cmp_1", content, 50, 20)]
    log = [Event(seq, ev.type, ev.data) for seq, ev in enumerate(b(task, i) for i, b in enumerate(builders))]
    assert [e.type for e in log][1:] == [
        "mlx.compaction.started",
        "mlx.compaction.completed",
        "response.output_item.added",
        "response.output_item.done",
    ]
    rebuilt = ResponseState.from_events(log)
    assert rebuilt.compaction_started == 50 and rebuilt.outputs.compacted
    assert rebuilt.outputs.items[0].text == content and not rebuilt.outputs.answered
    rebuilt.finish("stop", 20)  # an empty answer is still a message, after the compaction item
    assert [type(i).__name__ for i in rebuilt.response.output] == ["Compaction", "OutputMessage"]
