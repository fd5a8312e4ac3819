"""Prefill pacing: a long prompt admitted while others decode is prefilled in short steps."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from harness.wait import wait_until_async
from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.pacing import MIN_STEP, PrefillPacer
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ResolvedModel
from lmspd.prompting.generation import build_generate

GREEDY = p.SamplingParams(temperature=0.0)


def test_full_steps_when_nothing_decodes() -> None:
    pacer = PrefillPacer(512, 0.25)
    pacer.observe(100, 1.0)
    assert pacer.step_size(decoding=False) == 512


def test_starts_small_then_sizes_steps_to_the_budget() -> None:
    pacer = PrefillPacer(512, 0.25)
    assert pacer.step_size(decoding=True) == MIN_STEP
    pacer.observe(100, 1.0)  # 100 tokens/s: a quarter second is 25 tokens
    assert pacer.step_size(decoding=True) == 25


def test_the_rate_is_smoothed_and_bounded() -> None:
    pacer = PrefillPacer(512, 0.25)
    pacer.observe(100, 1.0)
    pacer.observe(300, 1.0)  # the mean of 100 and 300 tokens/s, half weight each
    assert pacer.step_size(decoding=True) == 50
    pacer.observe(10**6, 1.0)
    assert pacer.step_size(decoding=True) == 512  # never above prefill_step_size
    slow = PrefillPacer(512, 0.25)
    slow.observe(1, 10.0)  # 0.1 tokens/s
    assert slow.step_size(decoding=True) == MIN_STEP  # never below the floor


def test_no_budget_means_full_steps() -> None:
    pacer = PrefillPacer(512, 0.0)
    pacer.observe(100, 1.0)
    assert pacer.step_size(decoding=True) == 512


def test_nothing_measured_keeps_the_rate() -> None:
    pacer = PrefillPacer(512, 0.25)
    pacer.observe(100, 1.0)
    pacer.observe(0, 0.0)  # a step that prefilled nothing
    assert pacer.step_size(decoding=True) == 25


def generate(model: ResolvedModel, content: str, max_tokens: int) -> p.Generate:
    return build_generate(
        model,
        [{"role": "user", "content": content}],
        request_id=uuid.uuid4().hex,
        max_tokens=max_tokens,
        sampling=GREEDY,
    )


async def test_a_running_stream_keeps_decoding_while_a_long_prompt_is_admitted(tiny_long: ResolvedModel) -> None:
    # One step of up to 4,096 tokens would take the whole long prompt at once; a 1 ms budget
    # makes every step with a stream decoding prefill only a slice of it.
    engine = EngineClient(EngineConfig(weight_dtype="quantized", prefill_step_size=4096, prefill_interleave_ms=1))
    await engine.start()
    try:
        timeline: list[str] = []
        story = generate(tiny_long, "Tell me a story.", max_tokens=400)
        running = engine.generate(story)
        assert isinstance(await anext(running), p.Delta)
        long = generate(tiny_long, "word " * 1000, max_tokens=1)
        assert len(long.prompt) > 1000

        async def follow(stream: AsyncIterator[p.Delta | p.Finished], name: str) -> None:
            async for ev in stream:
                if isinstance(ev, p.Delta) and ev.token_ids:
                    timeline.append(name)
                if name == "long" and isinstance(ev, p.Finished):
                    return

        reader = asyncio.create_task(follow(running, "running"))
        # The running stream's tokens so far are read (none waits in its queue), so none that
        # came before the long prompt counts after it.
        backlog = engine._streams[story.request_id]
        await wait_until_async(backlog.empty, "the running stream's tokens so far to be read", interval=0.001)
        timeline.append("submitted")
        await follow(engine.generate(long), "long")
        between = timeline[timeline.index("submitted") : timeline.index("long")]
        # Unpaced, the long prompt is one prefill step, and the running stream gets at most
        # four tokens before the long one's first (a step in flight, the prefill step, the
        # step that moves it to decoding, its first token); paced, one per slice.
        assert between.count("running") >= 8
        reader.cancel()
    finally:
        await engine.close()
