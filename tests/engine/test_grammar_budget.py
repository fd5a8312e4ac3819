"""A grammar that cannot go on (its matcher fails, or spends its per-step budget) fails its own
request in the real engine; it never ends the output as if it were complete, and the other
requests of the batch carry on."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from support.generation import PROMPTS, collect, request

from lmspd.engine.process import EngineClient
from lmspd.errors import InvalidRequestError
from lmspd.models.registry import ResolvedModel
from lmspd.prompting import grammar
from lmspd.responses.tools import JsonSchemaFormat, tool_options

# Intake refuses these (no finite instance); sent to the engine directly, the first needs
# more parser work in one step than the budget allows, the second finds no token at all.
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
SELF = {"$ref": "#"}


def schema_grammar(schema: dict[str, object]) -> str:
    fmt = JsonSchemaFormat(name="out", schema=schema)
    lark = grammar.build(text_format=fmt, tools=tool_options(None, None, None, None), tool_format=None, special={})
    assert lark is not None
    return lark


@pytest.mark.parametrize("schema", [ENDLESS, SELF], ids=["step-budget", "no-token"])
async def test_a_grammar_that_cannot_go_on_fails_its_request_only(
    engine: EngineClient, tiny: ResolvedModel, schema: dict[str, object]
) -> None:
    free = request(tiny, PROMPTS[0], max_tokens=12)
    stuck = msgspec.structs.replace(request(tiny, PROMPTS[1], max_tokens=32), grammar=schema_grammar(schema))
    results = await asyncio.gather(collect(engine, free), collect(engine, stuck), return_exceptions=True)
    done, failed = results
    assert not isinstance(done, BaseException) and done[2].completion_tokens == 12
    assert isinstance(failed, InvalidRequestError), failed
    assert "grammar cannot go on" in failed.message
