"""A grammar that cannot go on (its matcher fails, or spends its per-step budget) fails its own
request in the real engine; it never ends the output as if it were complete, and the other
requests of the batch carry on."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from support.generation import PROMPTS, collect, request

from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.errors import InvalidRequestError
from lmspd.models.registry import ResolvedModel
from lmspd.prompting import grammar
from lmspd.responses.enforce import MAX_OPTIONAL_PROPERTIES
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


async def test_the_optional_property_limit_is_llguidances(engine: EngineClient, tiny: ResolvedModel) -> None:
    """Intake refuses an object with more optional properties than MAX_OPTIONAL_PROPERTIES
    (tests/unit/test_schema_budget.py) because past it llguidance's parser fails at the
    object's first key: here, an output resumed after its opening ``{"``."""
    from tokenizers import Tokenizer

    opening = Tokenizer.from_file(str(tiny.path / "tokenizer.json")).encode('{"', add_special_tokens=False).ids

    def resumed(optional: int) -> p.Generate:
        properties = {f"p{i}": {"type": "string"} for i in range(optional)}
        lark = schema_grammar({"type": "object", "properties": properties})
        return msgspec.structs.replace(request(tiny, PROMPTS[2], max_tokens=12), grammar=lark, generated=opening)

    _, _, fin = await collect(engine, resumed(MAX_OPTIONAL_PROPERTIES))  # a key (any: no additionalProperties)
    assert fin.completion_tokens > len(opening)
    with pytest.raises(InvalidRequestError, match="grammar"):
        await collect(engine, resumed(MAX_OPTIONAL_PROPERTIES + 1))
