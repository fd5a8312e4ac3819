"""Engine commands for the engine tier: a greedy chat request, and a whole stream collected
(its tokens and text, or its deltas as they came)."""

from __future__ import annotations

import uuid
from typing import Any

from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ResolvedModel
from lmspd.prompting.generation import build_generate

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
