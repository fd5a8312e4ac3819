"""Custom (freeform) tools under ``tool_choice: required`` on the tiny random-weight model,
sampled at temperature 1 over many seeds, streamed through the real prompt, grammar and
output parser: every call is a custom tool call whose input matches its grammar (Lark,
checked with llguidance's matcher; a regular expression, checked with ``regex.fullmatch``), its
streamed deltas are its input, and nothing else comes out.

Random weights seldom pick a newline, so a line of Codex's ``apply_patch`` grammar runs to any
budget: there every input is checked to be a prefix of a valid patch (and a whole one where it
ended); a small Lark grammar of bounded lines shows whole inputs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import regex
from llguidance import LLMatcher, LLTokenizer

from harness import DATA
from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ResolvedModel
from lmspd.prompting.generation import build_generate, prompt_for
from lmspd.responses import schema as s
from lmspd.responses.outputs import EventFactory, OutputItems
from lmspd.responses.schema import ResponseRequest

PATCH = (DATA / "codex_apply_patch.lark").read_text()
# A shell-like command: its characters can spell "</tool_call>", which the grammar must keep out.
COMMAND = r"(ls|cat|grep) [a-z0-9_./<>-]{1,24}( [a-z0-9_./<>-]{1,12}){0,2}"
APPLY_PATCH: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH},
}
SETTINGS = r"""start: entry ("\n" entry){0,2} "\n"?
entry: KEY "=" VALUE
KEY: /[a-z]{1,6}/
VALUE: /[0-9]{1,3}/ | "yes" | "no"
"""
CONFIG: dict[str, Any] = {
    "type": "custom",
    "name": "configure",
    "description": "Set options, one key=value a line",
    "format": {"type": "grammar", "syntax": "lark", "definition": SETTINGS},
}
SHELL: dict[str, Any] = {
    "type": "custom",
    "name": "shell",
    "description": "Run a command",
    "format": {"type": "grammar", "syntax": "regex", "definition": COMMAND},
}
SEEDS = range(12)


def matches_lark(tokenizer: LLTokenizer, definition: str, text: str, *, whole: bool) -> bool:
    """``text`` is in the grammar's language (``whole``), or a prefix of a string that is."""
    matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(definition), log_level=0)
    ok = matcher.consume_tokens(tokenizer.tokenize_str(text)) and not matcher.is_error()
    return bool(ok and (matcher.is_accepting() or not whole))


async def run(
    engine: EngineClient, model: ResolvedModel, request: ResponseRequest, seed: int, max_tokens: int
) -> tuple[list[s._Event], list[s.OutputItem], str]:
    """One sampled generation: its streamed events, output items and how it ended."""
    prompt = prompt_for(model, request, [])
    sampling = p.SamplingParams(temperature=1.0, seed=seed)
    request_id = f"custom-{seed}-{id(request)}"
    cmd = build_generate(model, prompt, request_id=request_id, max_tokens=max_tokens, sampling=sampling)
    items = OutputItems()
    items.attach(prompt.parser(), "", prompt.tools.namespaces)
    factories: list[EventFactory] = []
    reason = ""
    async for ev in engine.generate(cmd):
        factories += items.feed(ev.text, [])
        if isinstance(ev, p.Finished):
            reason = ev.reason
    factories += items.finish() + items.close("completed" if reason == "stop" else "incomplete")
    return [f(i) for i, f in enumerate(factories)], items.output(), reason


@pytest.fixture(scope="module")
def tokenizer(tiny_long: ResolvedModel) -> LLTokenizer:
    return LLTokenizer((Path(tiny_long.path) / "tokenizer.json").read_text())


@pytest.mark.parametrize("tool", [APPLY_PATCH, CONFIG, SHELL], ids=["apply_patch", "lark", "regex"])
async def test_required_custom_call_always_matches(
    engine: EngineClient, tiny_long: ResolvedModel, tokenizer: LLTokenizer, tool: dict[str, Any]
) -> None:
    request = ResponseRequest(input="Fix the bug.", tools=[tool], tool_choice="required", parallel_tool_calls=False)
    # apply_patch's lines run to any budget (above): a short one shows its prefixes as well.
    max_tokens = 80 if tool is APPLY_PATCH else 160
    results = await asyncio.gather(*(run(engine, tiny_long, request, seed, max_tokens) for seed in SEEDS))
    finished = 0
    for seed, (events, output, reason) in zip(SEEDS, results, strict=True):
        (call,) = output
        assert isinstance(call, s.CustomToolCall), f"seed {seed}: {output}"
        assert call.name == tool["name"] and call.id.startswith("ctc_") and call.call_id.startswith("call_")
        deltas = [e.delta for e in events if isinstance(e, s.CustomToolCallInputDelta)]
        (done,) = [e for e in events if isinstance(e, s.CustomToolCallInputDone)]
        assert "".join(deltas) == done.input == call.input, f"seed {seed}"
        whole = reason == "stop"
        assert call.status == ("completed" if whole else "incomplete"), f"seed {seed}: {call}"
        finished += whole
        if tool is SHELL:
            # Cut short, it is a prefix of a match.
            assert regex.fullmatch(COMMAND, call.input, partial=not whole), f"seed {seed}: {call.input!r}"
        else:
            definition = tool["format"]["definition"]
            assert matches_lark(tokenizer, definition, call.input, whole=whole), f"seed {seed}: {call.input!r}"
    if tool is not APPLY_PATCH:
        assert finished == len(SEEDS), "a bounded input ends within the budget"
