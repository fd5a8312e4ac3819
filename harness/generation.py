"""Engine commands for the engine tier: a greedy chat request, and a whole stream collected
(its tokens and text, or its deltas as they came)."""

from __future__ import annotations

import uuid
from typing import Any

from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ResolvedModel
from lmspd.prompting import grammar
from lmspd.prompting.generation import build_generate
from lmspd.responses.tools import JsonSchemaFormat, tool_options

GREEDY = p.SamplingParams(temperature=0.0)
PROMPTS = ["Tell me a story.", "What is 2 + 2?", "List three colours, please, in order.", "Hi"]


def request(model: ResolvedModel, prompt: str, max_tokens: int = 24, **kw: Any) -> p.Generate:
    return build_generate(
        model,
        [{"role": "user", "content": prompt}],
        request_id=uuid.uuid4().hex,
        max_tokens=max_tokens,
        sampling=kw.pop("sampling", GREEDY),
        **kw,
    )


async def collect(engine: EngineClient, cmd: p.Generate) -> tuple[list[int], str, p.Finished]:
    ids: list[int] = []
    text = ""
    async for ev in engine.generate(cmd):
        if isinstance(ev, p.Delta):
            ids += ev.token_ids
            text += ev.text
        else:
            return ids, text + ev.text, ev
    raise AssertionError("stream ended without Finished")


async def deltas_of(engine: EngineClient, cmd: p.Generate) -> tuple[list[p.Delta], p.Finished]:
    deltas: list[p.Delta] = []
    async for ev in engine.generate(cmd):
        if isinstance(ev, p.Delta):
            deltas.append(ev)
        else:
            return deltas, ev
    raise AssertionError("stream ended without Finished")


# A JSON schema the tiny model answers under (constrained decoding): an enum, a bounded integer,
# a bounded array.
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["colour", "count", "tags"],
    "additionalProperties": False,
}


def schema_grammar(schema: dict[str, object]) -> str:
    fmt = JsonSchemaFormat(name="out", schema=schema)
    lark = grammar.build(text_format=fmt, tools=tool_options(None, None, None, None), tool_format=None, special={})
    assert lark is not None
    return lark
