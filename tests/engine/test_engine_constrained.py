"""Constrained decoding in the real engine process (tiny random model): the grammar mask
makes even random weights produce valid JSON, in a batch with free requests, and a
resumed request continues under the same grammar."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import msgspec
import pytest

from harness.generation import PROMPTS, SCHEMA, collect, request, schema_grammar
from lmspd.engine.process import EngineClient
from lmspd.errors import InvalidRequestError
from lmspd.models.registry import ResolvedModel
from lmspd.prompting import grammar
from lmspd.responses.tools import tool_options


async def test_random_weights_give_valid_json_under_a_schema(engine: EngineClient, tiny: ResolvedModel) -> None:
    lark = schema_grammar(SCHEMA)
    free = request(tiny, PROMPTS[0], max_tokens=16)
    constrained = [msgspec.structs.replace(request(tiny, q, max_tokens=64), grammar=lark) for q in PROMPTS[:3]]
    results = await asyncio.gather(collect(engine, free), *(collect(engine, c) for c in constrained))
    assert results[0][2].completion_tokens == 16  # the free request in the same batch is unaffected
    for _, text, fin in results[1:]:
        assert fin.reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


async def test_resume_continues_under_the_grammar(engine: EngineClient, tiny: ResolvedModel) -> None:
    cmd = msgspec.structs.replace(request(tiny, PROMPTS[1], max_tokens=64), grammar=schema_grammar(SCHEMA))
    ids, _, _ = await collect(engine, cmd)
    cut = len(ids) // 2
    resumed = msgspec.structs.replace(cmd, request_id="resumed", generated=ids[:cut])
    rest, _, fin = await collect(engine, resumed)
    assert ids[:cut] + rest == ids
    assert fin.reason == "stop"


async def test_tool_call_required_is_a_valid_call(engine: EngineClient, tiny: ResolvedModel) -> None:
    tools = tool_options(
        [{"type": "function", "name": "pick", "parameters": SCHEMA}, {"type": "function", "name": "other"}],
        "required",
        False,
        None,
    )
    lark = grammar.build(text_format=None, tools=tools, tool_format="json_tools", special={})
    assert lark is not None
    _, text, fin = await collect(
        engine, msgspec.structs.replace(request(tiny, PROMPTS[2], max_tokens=96), grammar=lark)
    )
    assert fin.reason == "stop", text
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    if call["name"] == "pick":
        jsonschema.validate(call["arguments"], SCHEMA)
    else:
        assert call["name"] == "other" and isinstance(call["arguments"], dict)


async def test_a_grammar_that_does_not_compile_fails_only_its_request(
    engine: EngineClient, tiny: ResolvedModel
) -> None:
    bad = msgspec.structs.replace(request(tiny, PROMPTS[0], max_tokens=8), grammar="start: nope")
    with pytest.raises(InvalidRequestError, match="grammar"):
        await collect(engine, bad)
    _, _, fin = await collect(engine, request(tiny, PROMPTS[0], max_tokens=8))
    assert fin.completion_tokens == 8
