"""The real engine process with a tiny random-weight model: batching, cancel, crash, resume."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from harness.generation import PROMPTS, collect, deltas_of, request
from harness.wait import wait_until_async
from lmspd.config import EngineConfig, NumericsSetting
from lmspd.engine import protocol as p
from lmspd.engine.process import EARLY_CANCELS_KEPT, EngineClient
from lmspd.errors import (
    ContextLengthExceededError,
    EngineCrashedError,
    InvalidRequestError,
    ModelError,
)
from lmspd.models.registry import ResolvedModel
from lmspd.prompting.generation import tokenizer_for


async def test_generates_until_length(engine: EngineClient, tiny: ResolvedModel) -> None:
    ids, text, fin = await collect(engine, request(tiny, PROMPTS[0], max_tokens=16))
    assert fin.reason == "length"
    assert fin.completion_tokens == len(ids) == 16
    assert len(set(ids)) > 8  # the tiny model's output is varied, so comparisons below mean something
    assert fin.prompt_tokens == len(request(tiny, PROMPTS[0]).prompt)
    assert text == tokenizer_for(tiny).decode(ids)


async def test_concurrent_requests_equal_each_alone(engine: EngineClient, tiny: ResolvedModel) -> None:
    alone = [await collect(engine, request(tiny, q)) for q in PROMPTS]
    together = await asyncio.gather(*(collect(engine, request(tiny, q)) for q in PROMPTS))
    assert [a[0] for a in together] == [a[0] for a in alone]
    assert [a[1] for a in together] == [a[1] for a in alone]


async def test_requests_join_a_running_batch(engine: EngineClient, tiny: ResolvedModel) -> None:
    solo = await collect(engine, request(tiny, PROMPTS[1], max_tokens=12))
    long_stream = engine.generate(request(tiny, PROMPTS[0], max_tokens=120))
    assert isinstance(await anext(long_stream), p.Delta)  # the long request is decoding when the short one arrives

    async def long_finished() -> p.Finished:
        async for ev in long_stream:
            if isinstance(ev, p.Finished):
                return ev
        raise AssertionError("stream ended without Finished")

    long = asyncio.create_task(long_finished())
    late = await collect(engine, request(tiny, PROMPTS[1], max_tokens=12))
    assert not long.done()  # the short request finished while the long one was still running
    assert late[0] == solo[0]
    assert (await long).completion_tokens == 120


async def test_cancel_mid_generation(engine: EngineClient, tiny_long: ResolvedModel) -> None:
    cmd = request(tiny_long, PROMPTS[0], max_tokens=3000)
    seen = 0
    async for ev in engine.generate(cmd):
        if isinstance(ev, p.Delta):
            seen += len(ev.token_ids)
            if seen == 5:
                await engine.cancel(cmd.request_id)
        else:
            assert ev.reason == "cancelled"
            # How many steps the engine decodes before the cancel reaches it depends on the
            # machine's load, so the bound is "long before max_tokens", not a step count.
            assert 5 <= ev.completion_tokens == seen < 3000
            break
    # The engine keeps serving afterwards.
    assert (await collect(engine, request(tiny_long, PROMPTS[1], max_tokens=4)))[2].reason == "length"


async def test_cancel_before_generate_is_not_lost(engine: EngineClient, tiny: ResolvedModel) -> None:
    # The supervisor may cancel between deciding to run a request and sending it: the
    # engine has never heard of the id, so the client must remember the cancel.
    cmd = request(tiny, PROMPTS[0], max_tokens=12, generated=[42, 43])
    await engine.cancel(cmd.request_id)
    ids, text, fin = await collect(engine, cmd)
    assert (ids, text) == ([], "")
    assert fin.reason == "cancelled"
    assert fin.prompt_tokens == len(cmd.prompt)
    assert fin.completion_tokens == 2  # the tokens it was resumed with, none new
    assert engine.stats()["in_flight"] == 0
    # The cancel applied once: the same id runs normally afterwards.
    assert (await collect(engine, cmd))[2].reason == "length"


async def test_forget_drops_a_remembered_cancel(engine: EngineClient, tiny: ResolvedModel) -> None:
    cmd = request(tiny, PROMPTS[1], max_tokens=6)
    await engine.cancel(cmd.request_id)
    engine.forget(cmd.request_id)
    engine.forget("never-cancelled")  # forgetting an unknown id is harmless
    ids, _, fin = await collect(engine, cmd)
    assert fin.reason == "length"
    assert len(ids) == fin.completion_tokens == 6


async def test_remembered_cancels_are_bounded(engine: EngineClient, tiny: ResolvedModel) -> None:
    first = request(tiny, PROMPTS[1], max_tokens=3)
    await engine.cancel(first.request_id)
    for i in range(EARLY_CANCELS_KEPT):
        await engine.cancel(f"abandoned-{i}")
    # The oldest remembered cancel was dropped to make room, so its request runs.
    assert (await collect(engine, first))[2].reason == "length"
    last = request(tiny, PROMPTS[1], max_tokens=3)
    await engine.cancel(last.request_id)
    assert (await collect(engine, last))[2].reason == "cancelled"
    for i in range(EARLY_CANCELS_KEPT):  # the engine is shared: leave nothing remembered
        engine.forget(f"abandoned-{i}")


async def test_leaving_the_stream_cancels_the_request(engine: EngineClient, tiny: ResolvedModel) -> None:
    cmd = request(tiny, PROMPTS[0], max_tokens=500)
    async for ev in engine.generate(cmd):
        assert isinstance(ev, p.Delta)
        break
    # The event loop closes the abandoned stream soon after (its async-generator finalizer).
    await wait_until_async(lambda: engine.stats()["in_flight"] == 0, "the abandoned stream to close", timeout=5)
    _, _, fin = await collect(engine, request(tiny, PROMPTS[1], max_tokens=3))
    assert fin.completion_tokens == 3


async def test_resume_from_snapshot_equals_uninterrupted(engine: EngineClient, tiny: ResolvedModel) -> None:
    full_ids, full_text, full = await collect(engine, request(tiny, PROMPTS[2], max_tokens=40))
    for cut in (1, 7, 23, 39):
        cmd = request(tiny, PROMPTS[2], max_tokens=40, generated=full_ids[:cut])
        ids, text, fin = await collect(engine, cmd)
        assert full_ids[:cut] + ids == full_ids
        assert tokenizer_for(tiny).decode(full_ids[:cut]) + text == full_text
        assert fin.completion_tokens == full.completion_tokens == 40


@pytest.mark.parametrize("numerics", ["exact", "fast"])
async def test_a_long_resume_equals_uninterrupted_on_either_path(
    tiny_long: ResolvedModel, numerics: NumericsSetting
) -> None:
    """Cut after more tokens than one pass of decode rows: the generated tokens are prefilled
    in pieces that carry decode steps' bits (admission.resumed_segments), so even the fast
    path's 8-bit activations continue exactly as the uninterrupted run."""
    # No prompt cache: a finished answer's cache would hold the cut's tokens, computed as decoded.
    client = EngineClient(EngineConfig(numerics=numerics, prompt_cache_max_bytes=0))
    await client.start()

    async def answer(generated: list[int]) -> tuple[list[int], list[float]]:
        cmd = request(tiny_long, PROMPTS[2], max_tokens=100, generated=generated, logprobs=0)
        deltas, fin = await deltas_of(client, cmd)
        assert fin.completion_tokens == 100
        return [t for d in deltas for t in d.token_ids], [e.logprob for d in deltas for e in d.logprobs or []]

    try:
        full_ids, full_logprobs = await answer([])
        for cut in (33, 64, 97):
            ids, logprobs = await answer(full_ids[:cut])
            assert full_ids[:cut] + ids == full_ids, cut
            # The same numbers, not only the same picks: the tiny model's picks rarely tie.
            assert logprobs == full_logprobs[cut:], cut
    finally:
        await client.close()


async def test_kill_9_ends_in_flight_requests_with_engine_crashed(tiny: ResolvedModel) -> None:
    client = EngineClient(EngineConfig(weight_dtype="quantized"))
    await client.start()
    try:
        generating: set[str] = set()  # the requests whose first token came

        async def generate(cmd: p.Generate) -> None:
            async for _ in client.generate(cmd):
                generating.add(cmd.request_id)

        streams = [asyncio.create_task(generate(request(tiny, q, max_tokens=5000 // 20))) for q in PROMPTS]
        # Killed mid-generation: once every request has its first token, not after a pause.
        await wait_until_async(lambda: len(generating) == len(PROMPTS), "every request to generate", interval=0.005)
        assert client.process is not None and client.process.pid is not None
        os.kill(client.process.pid, signal.SIGKILL)
        for s in streams:
            with pytest.raises(EngineCrashedError):
                await s
        assert not client.alive
        with pytest.raises(EngineCrashedError):
            await collect(client, request(tiny, PROMPTS[1]))
        await client.start()  # a restart serves again
        assert (await collect(client, request(tiny, PROMPTS[1], max_tokens=4)))[2].reason == "length"
    finally:
        await client.close()


async def test_context_length_exceeded_before_generation(engine: EngineClient, tiny: ResolvedModel) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        request(tiny, "word " * 300)
    assert info.value.param == "input"
    # The engine checks too, for commands built elsewhere (e.g. a resumed snapshot).
    cmd = request(tiny, PROMPTS[1], generated=[42] * 250)
    with pytest.raises(ContextLengthExceededError):
        await collect(engine, cmd)


@pytest.mark.parametrize(
    ("params", "name"),
    [
        (p.SamplingParams(temperature=-0.1), "temperature"),
        (p.SamplingParams(temperature=2.5), "temperature"),
        (p.SamplingParams(top_p=0.0), "top_p"),
        (p.SamplingParams(top_p=1.5), "top_p"),
        (p.SamplingParams(top_k=-1), "top_k"),
        (p.SamplingParams(min_p=2.0), "min_p"),
    ],
)
def test_invalid_sampling_parameters_name_the_parameter(
    tiny: ResolvedModel, params: p.SamplingParams, name: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request(tiny, "hi", sampling=params)
    assert info.value.param == name
    assert name in str(info.value)


async def test_engine_rejects_invalid_sampling_too(engine: EngineClient, tiny: ResolvedModel) -> None:
    cmd = request(tiny, "hi")
    bad = p.Generate(
        request_id="bad",
        model=cmd.model,
        path=cmd.path,
        prompt=cmd.prompt,
        max_tokens=4,
        sampling=p.SamplingParams(top_p=0.0),
    )
    with pytest.raises(InvalidRequestError) as info:
        await collect(engine, bad)
    assert info.value.param == "top_p"


async def test_sampling_with_temperature_runs(engine: EngineClient, tiny: ResolvedModel) -> None:
    sampling = p.SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    ids, _, fin = await collect(engine, request(tiny, PROMPTS[0], max_tokens=10, sampling=sampling))
    assert len(ids) == fin.completion_tokens == 10


async def test_stop_strings_cut_the_text(engine: EngineClient, tiny: ResolvedModel) -> None:
    _, text, _ = await collect(engine, request(tiny, PROMPTS[0], max_tokens=30))
    stop = text[10:14]
    assert stop.strip()
    _, cut, fin = await collect(engine, request(tiny, PROMPTS[0], max_tokens=30, stop=[stop]))
    assert fin.reason == "stop"
    assert cut == text[: text.index(stop)]


async def test_unloadable_model_is_an_error(engine: EngineClient, tmp_path: object) -> None:
    cmd = p.Generate(request_id="x", model="ghost", path="/nonexistent/model", prompt=[1, 2, 3], max_tokens=4)
    with pytest.raises(ModelError, match="ghost"):
        await collect(engine, cmd)


async def test_lru_eviction_switches_models(engine: EngineClient, tiny: ResolvedModel, tiny2: ResolvedModel) -> None:
    # The shared engine is idle, with room for one model: what this test is about.
    assert engine.config.max_loaded_models == 1
    a1 = await collect(engine, request(tiny, PROMPTS[0], max_tokens=8))
    b = await collect(engine, request(tiny2, PROMPTS[0], max_tokens=8))
    # The engine says what it evicted, so the client knows what is resident.
    assert set(engine.loaded) == {"tiny2"} and engine.resident("tiny2") and not engine.resident("tiny")
    a2 = await collect(engine, request(tiny, PROMPTS[0], max_tokens=8))
    assert set(engine.loaded) == {"tiny"}
    assert a1[0] == a2[0] != b[0]
    # Two models wanted at once with room for one: the second waits, then runs.
    both = await asyncio.gather(
        collect(engine, request(tiny, PROMPTS[0], max_tokens=8)),
        collect(engine, request(tiny2, PROMPTS[0], max_tokens=8)),
    )
    assert [r[0] for r in both] == [a1[0], b[0]]


async def test_engine_rejects_bad_commands_and_keeps_serving(engine: EngineClient, tiny: ResolvedModel) -> None:
    good = request(tiny, PROMPTS[1], max_tokens=3)
    for bad in (
        p.Generate(request_id="neg", model=good.model, path=good.path, prompt=good.prompt, max_tokens=0),
        p.Generate(request_id="empty", model=good.model, path=good.path, prompt=[], max_tokens=3),
        p.Generate(request_id="oov", model=good.model, path=good.path, prompt=[10**9], max_tokens=3),
    ):
        with pytest.raises(InvalidRequestError):
            await collect(engine, bad)
    assert (await collect(engine, good))[2].completion_tokens == 3


async def test_loading_a_loaded_model_answers(engine: EngineClient, tiny: ResolvedModel) -> None:
    first = await engine.load(tiny.name, str(tiny.path))
    again = await asyncio.wait_for(engine.load(tiny.name, str(tiny.path)), 10)
    assert again.weight_dtype == first.weight_dtype


def seeded(seed: int, **kw: float) -> p.SamplingParams:
    return p.SamplingParams(temperature=1.0, seed=seed, **kw)  # type: ignore[arg-type]


async def test_the_same_seed_samples_the_same_tokens(engine: EngineClient, tiny: ResolvedModel) -> None:
    first = await collect(engine, request(tiny, PROMPTS[0], sampling=seeded(7)))
    again = await collect(engine, request(tiny, PROMPTS[0], sampling=seeded(7)))
    other = await collect(engine, request(tiny, PROMPTS[0], sampling=seeded(8)))
    greedy = await collect(engine, request(tiny, PROMPTS[0]))
    assert len(first[0]) == 24
    assert first[:2] == again[:2]
    assert other[0] != first[0]
    assert greedy[0] not in (first[0], other[0])  # it really samples


async def test_a_seed_applies_top_p_top_k_and_min_p(engine: EngineClient, tiny: ResolvedModel) -> None:
    # top_k=1 (and a tiny top_p) leave only the most likely token: greedy output, seeded or not.
    greedy = (await collect(engine, request(tiny, PROMPTS[1])))[0]
    for params in (seeded(3, top_k=1), seeded(3, top_p=1e-6), seeded(3, min_p=1.0)):
        assert (await collect(engine, request(tiny, PROMPTS[1], sampling=params)))[0] == greedy


async def test_a_seeded_request_is_unaffected_by_its_batch(engine: EngineClient, tiny: ResolvedModel) -> None:
    # Exact because MLX's CPU backend computes each batch row as it would alone (checked:
    # logprobs batched and alone are bit-identical); a backend whose kernels depended on
    # the batch size could only promise this for a batch of the same composition.
    alone = await collect(engine, request(tiny, PROMPTS[2], sampling=seeded(11)))
    # Its neighbours sample from the shared generator and from their own seeds meanwhile.
    together = await asyncio.gather(
        collect(engine, request(tiny, PROMPTS[0], sampling=p.SamplingParams(temperature=1.0))),
        collect(engine, request(tiny, PROMPTS[2], sampling=seeded(11))),
        collect(engine, request(tiny, PROMPTS[1], sampling=seeded(12))),
        collect(engine, request(tiny, PROMPTS[3], max_tokens=40)),
    )
    assert together[1][:2] == alone[:2]
    # Joining a batch that is already decoding changes nothing either.
    long = engine.generate(request(tiny, PROMPTS[0], max_tokens=200, sampling=seeded(13)))
    assert isinstance(await anext(long), p.Delta)
    late = await collect(engine, request(tiny, PROMPTS[2], sampling=seeded(11)))
    await long.aclose()
    assert late[:2] == alone[:2]


async def test_a_resumed_seeded_request_continues_as_if_uninterrupted(
    engine: EngineClient, tiny: ResolvedModel
) -> None:
    full_ids, _, _ = await collect(engine, request(tiny, PROMPTS[0], sampling=seeded(5)))
    for cut in (1, 10, 23):
        cmd = request(tiny, PROMPTS[0], sampling=seeded(5), generated=full_ids[:cut])
        ids, _, fin = await collect(engine, cmd)
        assert full_ids[:cut] + ids == full_ids
        assert fin.completion_tokens == 24


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**64 - 1])
async def test_any_64_bit_seed_is_accepted(engine: EngineClient, tiny: ResolvedModel, seed: int) -> None:
    ids, _, _ = await collect(engine, request(tiny, PROMPTS[1], max_tokens=4, sampling=seeded(seed)))
    assert len(ids) == 4


def test_a_seed_beyond_64_bits_is_rejected(tiny: ResolvedModel) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request(tiny, "hi", sampling=seeded(2**64))
    assert info.value.param == "seed"
