"""Under ``tool_choice: required`` or a named function only calls come out (issue 22):
the tiny random-weight model, sampled at temperature 1 over many seeds, streamed through the
real prompt, grammar and output parser. Random weights wander wherever the grammar lets
them, into long strings, markers' text, every separator; whatever they write must read back
as calls whose arguments validate, and nothing else."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest

from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ResolvedModel
from lmspd.prompting.generation import build_generate, prompt_for
from lmspd.responses import schema as s
from lmspd.responses.outputs import OutputItems
from lmspd.responses.schema import ResponseRequest

NOTE = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "maxLength": 48},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["text"],
    "additionalProperties": False,
}
COUNT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "unit": {"enum": ["m", "s"]}},
    "required": ["n", "unit"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "note", "description": "Write a note", "parameters": NOTE},
    {"type": "function", "name": "count", "description": "Count", "parameters": COUNT},
]
SCHEMAS = {"note": NOTE, "count": COUNT}
SEEDS = range(16)


async def run(
    engine: EngineClient, model: ResolvedModel, request: ResponseRequest, seed: int
) -> tuple[OutputItems, str]:
    """One generation, streamed into output items delta by delta as the server does; and how it ended."""
    prompt = prompt_for(model, request, [])
    sampling = p.SamplingParams(temperature=1.0, seed=seed)
    cmd = build_generate(model, prompt, request_id=f"forced-{seed}-{id(request)}", max_tokens=160, sampling=sampling)
    items = OutputItems()
    items.attach(prompt.parser(), "", prompt.tools.namespaces)
    reason = ""
    async for ev in engine.generate(cmd):
        items.feed(ev.text, [])
        if isinstance(ev, p.Finished):
            reason = ev.reason
    items.finish()
    items.close("completed" if reason == "stop" else "incomplete")
    return items, reason


def only_valid_calls(items: OutputItems, reason: str, seed: int, names: set[str], limit: int | None) -> None:
    output = items.output()
    assert output, f"seed {seed}: no output"
    assert all(isinstance(item, s.FunctionCall) for item in output), f"seed {seed}: {output}"
    assert limit is None or len(output) <= limit
    assert reason in ("stop", "length")
    # Out of tokens, the call being written stays incomplete; every call before it is whole.
    whole = output if reason == "stop" else output[:-1]
    for item in whole:
        assert isinstance(item, s.FunctionCall)
        assert item.status == "completed" and item.name in names, f"seed {seed}: {item}"
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


@pytest.mark.parametrize(
    ("choice", "parallel", "max_calls", "names", "limit"),
    [
        ("required", True, None, {"note", "count"}, None),
        ("required", True, 2, {"note", "count"}, 2),
        ("required", False, None, {"note", "count"}, 1),
        ({"type": "function", "name": "note"}, True, None, {"note"}, 1),
    ],
    ids=["required-parallel", "required-max2", "required-single", "named"],
)
async def test_forced_choice_gives_only_valid_calls(
    engine: EngineClient,
    tiny_long: ResolvedModel,
    choice: str | dict[str, str],
    parallel: bool,
    max_calls: int | None,
    names: set[str],
    limit: int | None,
) -> None:
    request = ResponseRequest(
        input="Take a note, then count.",
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        max_tool_calls=max_calls,
        temperature=1.0,
    )
    results = await asyncio.gather(*(run(engine, tiny_long, request, seed) for seed in SEEDS))
    for seed, (items, reason) in zip(SEEDS, results, strict=True):
        only_valid_calls(items, reason, seed, names, limit)
    # Bounded strings and lists: most runs end by themselves, under the grammar.
    assert sum(reason == "stop" for _, reason in results) >= len(SEEDS) // 2
