"""Custom (freeform) tool calls without a model: the Hermes block that carries one, read in any
cut; the items they become and their events rebuilt from the log; the input items that send
them back, rendered as they were generated; the intake checks of their grammars."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from llguidance import LLMatcher, LLTokenizer

from harness.families import FAMILY_FORMAT, make_family_tokenizer
from lmspd.errors import InvalidRequestError
from lmspd.models.tokenizer import Tokenizer
from lmspd.prompting.prompt import build_prompt
from lmspd.responses import schema as s
from lmspd.responses.enforce import SchemaBudget, SchemaError, check_directives
from lmspd.responses.inputs import CustomToolCallItem, item_json, parse_items, to_messages
from lmspd.responses.items import resources
from lmspd.responses.outputs import OutputItems
from lmspd.responses.parsing.output_parser import ArgumentsDelta, CallDone, CallStarted, OutputParser, TextDelta
from lmspd.responses.reasoning_echo import turn_key, turns
from lmspd.responses.schema import ResponseRequest
from lmspd.responses.tools import directives

NO_THINKING = {"enable_thinking": False}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+<tool_call> inside\n*** End Patch\n"
TEXT = (
    "Let me fix it.\n<tool_call>\napply_patch\n" + PATCH + "</tool_call>\n"
    '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
)


def parser() -> OutputParser:
    return OutputParser(tool_format="json_tools", tools=[{"type": "function", "name": "ls"}], custom=["apply_patch"])


@pytest.mark.parametrize("cut", range(len(TEXT) + 1))
def test_a_custom_call_reads_the_same_however_it_is_cut(cut: int) -> None:
    p = parser()
    pieces = p.feed(TEXT[:cut]) + p.feed(TEXT[cut:]) + p.finish()
    assert "".join(x.text for x in pieces if isinstance(x, TextDelta)) == "Let me fix it."
    started = [x for x in pieces if isinstance(x, CallStarted)]
    assert [(x.name, x.custom) for x in started] == [("apply_patch", True), ("ls", False)]
    done = [x for x in pieces if isinstance(x, CallDone)]
    assert (done[0].arguments, done[0].custom, done[0].valid) == (PATCH, True, True)
    assert json.loads(done[1].arguments) == {"path": "."}


def test_items_and_events_replay_from_the_log() -> None:
    live = OutputItems()
    live.attach(parser(), "")
    factories = [*live.feed(TEXT, []), *live.finish(), *live.close("completed")]
    events = [f(i) for i, f in enumerate(factories)]
    decoded = [s.event_decoder.decode(s.encoder.encode(e)) for e in events]
    kinds = [type(e).__name__ for e in decoded]
    first = kinds.index("CustomToolCallInputDelta")
    assert kinds[first - 1] == "OutputItemAdded" and "CustomToolCallInputDone" in kinds
    call = live.output()[1]
    assert isinstance(call, s.CustomToolCall) and call.input == PATCH and call.id.startswith("ctc_")
    deltas = "".join(e.delta for e in decoded if isinstance(e, s.CustomToolCallInputDelta))
    assert deltas == PATCH
    for cut in range(len(decoded) + 1):  # a resumed task replays its log up to any event
        rebuilt = OutputItems()
        for event in decoded[:cut]:
            rebuilt.replay(event)
        added = sum(isinstance(e, s.OutputItemAdded) for e in decoded[:cut])
        assert len(rebuilt.items) == added
    assert rebuilt.output() == live.output()


def test_a_namespaced_custom_call_names_its_namespace() -> None:
    items = OutputItems()
    p = OutputParser(tool_format="json_tools", tools=[], custom=["codex.apply_patch"])
    items.attach(p, "", {"codex.apply_patch": "codex"})
    items.feed("<tool_call>\ncodex.apply_patch\nx</tool_call>", [])
    items.finish()
    (call,) = items.output()
    assert isinstance(call, s.CustomToolCall)
    assert (call.name, call.namespace, call.input) == ("apply_patch", "codex", "x")


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Fix it"},
    {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": PATCH, "id": "ctc_1"},
    {"type": "custom_tool_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "Done!"}]},
]


def test_custom_items_render_as_generated() -> None:
    items = parse_items(HISTORY)
    hermes = to_messages(items)
    assert hermes[1] == {"role": "assistant", "content": f"<tool_call>\napply_patch\n{PATCH}</tool_call>"}
    assert hermes[2] == {"role": "user", "content": "<tool_response>\nDone!\n</tool_response>"}
    native = to_messages(items, native_tools=True)
    assert native[2] == {"role": "tool", "tool_call_id": "call_1", "content": "Done!"}
    listed = resources("resp_x", items)
    assert listed[1]["type"] == "custom_tool_call" and listed[1]["input"] == PATCH
    assert listed[2]["type"] == "custom_tool_call_output" and listed[2]["output"] == HISTORY[2]["output"]
    (turn,) = turns(items)
    other = msgspec.structs.replace(items[1], input="other")
    assert isinstance(other, CustomToolCallItem)
    assert turn_key(items[turn.start : turn.end]) != turn_key([other])


def test_media_in_a_custom_output_is_refused() -> None:
    bad = [{"type": "custom_tool_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "x"}]}]
    with pytest.raises(Exception, match="not supported") as info:
        parse_items(bad)
    assert getattr(info.value, "param", None) == "input[0].output[0].type"


def custom(definition: str, syntax: str = "lark") -> dict[str, Any]:
    return {"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": syntax, "definition": definition}}


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        (custom("start: nope"), "tools[1].format.definition"),
        (custom("a(b", "regex"), "tools[1].format.definition"),
        (custom('start: "a"\n}\nstart2: "b"'), "tools[1].format.definition"),  # cannot close the nesting
        ({"type": "namespace", "name": "ns", "tools": [custom("start: x")]}, "tools[1].tools[0].format.definition"),
    ],
)
def test_a_bad_grammar_is_a_400_naming_it(tool: dict[str, Any], param: str) -> None:
    parsed = directives(
        tools=[{"type": "function", "name": "f"}, tool],
        tool_choice=None,
        parallel_tool_calls=None,
        max_tool_calls=None,
        text=None,
        reasoning=None,
    )
    with pytest.raises(SchemaError) as info:
        check_directives(parsed, SchemaBudget())
    assert info.value.param == param


def test_a_grammar_counts_against_the_schema_budget() -> None:
    parsed = directives(
        tools=[custom('start: "' + "a" * 200 + '"')],
        tool_choice=None,
        parallel_tool_calls=None,
        max_tool_calls=None,
        text=None,
        reasoning=None,
    )
    with pytest.raises(SchemaError, match="max_schema_chars") as info:
        check_directives(parsed, SchemaBudget(max_chars=100))
    assert info.value.param == "tools[0].format.definition"


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_family_tokenizer(root / family, smol_dir, family) for family in FAMILY_FORMAT}


# A custom call of tool "t" with input "xab\n", as each family that can carry one writes it.
FAMILY_CALLS = {
    "json_tools": "<tool_call>\nt\nxab\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=t>\n<parameter=input>\nxab\n\n</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("family", list(FAMILY_FORMAT))
def test_each_family_carries_a_custom_call_or_refuses_it(family_dirs: dict[str, Path], family: str) -> None:
    """Hermes (here a native template whose markers are special tokens) and Qwen3-Coder carry
    raw input under the grammar; the others have no way to and answer 400 naming the tool."""
    tok = Tokenizer(family_dirs[family])
    tools: Any = [{"type": "function", "name": "ls"}, custom('start: "x" /[a-z]{1,3}/ "\\n"')]
    request = ResponseRequest(input="Go", tools=tools, tool_choice="required", chat_template_kwargs=NO_THINKING)
    call = FAMILY_CALLS.get(FAMILY_FORMAT[family])
    if call is None:
        with pytest.raises(InvalidRequestError) as info:
            build_prompt(tok, request, [])
        assert info.value.param == "tools[1].type"
        return
    prompt = build_prompt(tok, request, [])
    assert prompt.grammar is not None and "# Custom tools" in prompt.text and '"type": "custom"' in prompt.text
    lltok = LLTokenizer((family_dirs[family] / "tokenizer.json").read_text())
    matcher = LLMatcher(lltok, LLMatcher.grammar_from_lark(prompt.grammar), log_level=0)
    assert matcher.consume_tokens(lltok.tokenize_str(call)) and matcher.is_accepting(), matcher.get_error()
    for cut in range(len(call) + 1):
        p = prompt.parser()
        pieces = p.feed(call[:cut]) + p.feed(call[cut:]) + p.finish()
        (done,) = [x for x in pieces if isinstance(x, CallDone)]
        assert (done.name, done.arguments, done.custom, done.valid) == ("t", "xab\n", True, True), cut
        streamed = "".join(x.delta for x in pieces if isinstance(x, ArgumentsDelta))
        assert streamed == "xab\n", cut
    # A call sent back renders as it was generated.
    items = parse_items([{"type": "custom_tool_call", "call_id": "c", "name": "t", "input": "xab\n"}])
    history = build_prompt(tok, msgspec.structs.replace(request, input=[*HISTORY[:1], *map(item_json, items)]), [])
    assert call in history.text
