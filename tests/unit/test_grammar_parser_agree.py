"""The parser reads a forced call exactly as the grammar let it through.

A grammar's JSON strings may hold any text, the end marker's too: a call whose argument
holds ``</tool_call>`` is one call, not a broken call followed by message text (the Agents
SDK saw that under ``required``: then the model stayed inside the string to the budget)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer

from harness.families import make_family_tokenizer
from lmspd.models.tokenizer import Tokenizer
from lmspd.prompting.prompt import build_prompt
from lmspd.responses.parsing.output_parser import CallDone, ReasoningDelta, TextDelta
from lmspd.responses.schema import ResponseRequest

PARAMS = {
    "type": "object",
    "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["note", "n"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [{"type": "function", "name": "save", "parameters": PARAMS}]
NOTES = ["a</tool_call>b", "</tool_call>\n<tool_call>", '\\"</tool_call>{"', "x\n</tool_call>\nHello there"]


@pytest.fixture(scope="module")
def tok(smol_dir: Path) -> Tokenizer:
    return Tokenizer(smol_dir)


def accepted(lark: str, text: str | list[str], tokenizer_json: Path) -> bool:
    """``text`` is in the grammar's language, tokenized as a whole or piece by piece (a model
    may spell a special token's text in ordinary tokens)."""
    tokenizer = LLTokenizer(tokenizer_json.read_text())
    matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(lark), log_level=0)
    tokens = [t for piece in ([text] if isinstance(text, str) else text) for t in tokenizer.tokenize_str(piece)]
    return bool(matcher.consume_tokens(tokens) and matcher.is_accepting())


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "save"}])
@pytest.mark.parametrize("note", NOTES)
def test_an_end_marker_inside_a_string_is_part_of_it(
    tok: Tokenizer, smol_dir: Path, choice: str | dict[str, str], note: str
) -> None:
    request = ResponseRequest(input="Save it.", tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    prompt = build_prompt(tok, request, [])
    assert prompt.grammar is not None and prompt.tool_format == "json_tools"
    arguments = json.dumps({"note": note, "n": 3}, ensure_ascii=False)
    text = f'<tool_call>\n{{"name": "save", "arguments": {arguments}}}\n</tool_call>'
    assert accepted(prompt.grammar, text, smol_dir / "tokenizer.json")  # the grammar lets it through
    for cut in range(len(text) + 1):  # however the text came in
        parser = prompt.parser()
        pieces = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert not [p for p in pieces if isinstance(p, TextDelta)], (cut, pieces)
        (done,) = [p for p in pieces if isinstance(p, CallDone)]
        assert done.valid and json.loads(done.arguments) == {"note": note, "n": 3}, cut


def test_a_qwen3_coder_string_value_can_end(smol_dir: Path, tmp_path: Path) -> None:
    """A string parameter's text and its closing newline are one lexeme: as two, llguidance's
    greedy lexer took the newline into the text, so ``</parameter>`` could never follow and
    every string ran to its maxLength (256 when unset)."""
    family = make_family_tokenizer(tmp_path / "qwen3_coder", smol_dir, "qwen3_coder")
    request = ResponseRequest(input="Save it.", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    prompt = build_prompt(Tokenizer(family), request, [])
    assert prompt.grammar is not None and prompt.tool_format == "qwen3_coder"
    text = (
        "<tool_call>\n<function=save>\n<parameter=note>\nhi\nthere\n</parameter>\n"
        "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    assert accepted(prompt.grammar, text, family / "tokenizer.json")
    parser = prompt.parser()
    (done,) = [p for p in parser.feed(text) + parser.finish() if isinstance(p, CallDone)]
    assert done.valid and json.loads(done.arguments) == {"note": "hi\nthere", "n": 3}


def test_a_call_marker_inside_forced_reasoning_is_reasoning(smol_dir: Path, tmp_path: Path) -> None:
    """When the prompt opens the reasoning block, the grammar lets the thought run to its
    closing marker and only then the calls: a call marker inside the thought is thought."""
    family = make_family_tokenizer(tmp_path / "hermes_think", smol_dir, "hermes_think")
    request = ResponseRequest(input="Save it.", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    prompt = build_prompt(Tokenizer(family), request, [])
    assert prompt.grammar is not None and prompt.reasoning_open
    thought = 'I could write <tool_call>\n{"name": "save"} here, or not.'
    arguments = json.dumps({"note": "x", "n": 1})
    call = f'\n</think>\n\n<tool_call>\n{{"name": "save", "arguments": {arguments}}}\n</tool_call>'
    text = thought + call
    # In the thought the marker is spelled in ordinary tokens: a text lexeme holds no special token.
    before, after = thought.split("<tool_call>")
    assert accepted(prompt.grammar, [before, *"<tool_call>", after + call], family / "tokenizer.json")
    for cut in range(len(text) + 1):
        parser = prompt.parser()
        pieces = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert "".join(p.text for p in pieces if isinstance(p, ReasoningDelta)).strip() == thought, cut
        (done,) = [p for p in pieces if isinstance(p, CallDone)]
        assert done.valid and json.loads(done.arguments) == {"note": "x", "n": 1}, cut
