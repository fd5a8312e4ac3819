"""A grammar that cannot go on (its matcher fails, or spends its per-step budget) fails its own
request in the real engine; it never ends the output as if it were complete, and the other
requests of the batch carry on."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest

from harness.generation import PROMPTS, collect, request, schema_grammar
from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.errors import InvalidRequestError
from lmspd.models.registry import ResolvedModel
from lmspd.responses.enforce import MAX_OPTIONAL_PROPERTIES

# Intake refuses these (no finite instance); sent to the engine directly, the first needs
# more parser work in one step than the budget allows, the second finds no token at all.
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
SELF = {"$ref": "#"}


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


def constrained(cmd: p.Generate, lark: str) -> p.Generate:
    return msgspec.structs.replace(cmd, grammar=lark)


def slow_grammar() -> str:
    """A grammar this engine has not compiled yet whose compile takes many decode steps of the
    tiny model (a thousand regexes to intersect; intake would refuse it, as too large)."""
    name = f"a{uuid.uuid4().hex[:8]}"
    entry = {"properties": {name: {"type": "string", "pattern": "^[a-z]+$"}}}
    return schema_grammar({"type": "object", "allOf": [entry] * 1000})


async def test_a_grammar_compiles_while_the_batch_decodes(engine: EngineClient, tiny_long: ResolvedModel) -> None:
    """The compile used to run in the engine's loop: every running request waited for it (4-5
    tokens here while the constrained request compiled and started, ~60 now: compile and
    decode steps both scale with the machine, so the bound is a count of steps)."""
    running = request(tiny_long, PROMPTS[0], max_tokens=3000)
    joined: asyncio.Task[tuple[list[int], str, p.Finished]] | None = None
    meanwhile = 0
    async for ev in engine.generate(running):
        if not isinstance(ev, p.Delta):
            assert ev.reason == "cancelled" and joined is not None and joined.done(), ev
            break
        if joined is None:
            joined = asyncio.create_task(
                collect(engine, constrained(request(tiny_long, PROMPTS[1], max_tokens=2), slow_grammar()))
            )
        elif not joined.done():
            meanwhile += len(ev.token_ids)
        else:
            await engine.cancel(running.request_id)
    assert joined is not None
    ids, _, fin = await joined
    assert fin.reason in ("length", "stop") and ids
    assert meanwhile >= 20, f"the running request got {meanwhile} tokens while the grammar compiled"


async def test_a_request_cancelled_while_its_grammar_compiles_ends_cancelled(
    engine: EngineClient, tiny: ResolvedModel
) -> None:
    cmd = constrained(request(tiny, PROMPTS[2], max_tokens=8), slow_grammar())
    stream = engine.generate(cmd)
    first = asyncio.create_task(anext(stream))
    await asyncio.sleep(0)  # the Generate goes first (were the cancel first, it would still apply)
    await engine.cancel(cmd.request_id)
    ev = await first
    while isinstance(ev, p.Delta):
        ev = await anext(stream)
    assert ev.reason == "cancelled"
    assert (await collect(engine, request(tiny, PROMPTS[0], max_tokens=4)))[2].completion_tokens == 4
