"""A long-lived engine: idle models are unloaded and their memory returned; operators unload
and pin; the engine reports what it holds."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator

import pytest

from harness.generation import PROMPTS, collect, request
from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.errors import ModelTooLargeError
from lmspd.models.footprint import estimate_or_zero, weight_bytes
from lmspd.models.registry import ResolvedModel

# Weights dequantized to float32: the tiny model then holds about 13 MB, enough for the
# engine's RSS to show it leaving.
IDLE = EngineConfig(weight_dtype="float32", max_concurrency=2, max_loaded_models=2, keep_alive_secs=0.5)


@pytest.fixture
async def idle_engine() -> AsyncIterator[EngineClient]:
    client = EngineClient(IDLE)
    await client.start()
    yield client
    await client.close()


def unloads(engine: EngineClient) -> asyncio.Queue[tuple[str, str]]:
    """(model, reason) of each unload the engine reports, as it reports it."""
    queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    def heard(event: str, model: str, reason: str) -> None:
        if event == "unloaded":
            queue.put_nowait((model, reason))

    engine.listeners.append(heard)
    return queue


def state_of(status: p.EngineStatus, model: str) -> p.ModelState:
    return next(m for m in status.models if m.model == model)


async def test_an_idle_model_is_unloaded_and_its_memory_returned(
    idle_engine: EngineClient, tiny: ResolvedModel
) -> None:
    heard = unloads(idle_engine)
    before = (await idle_engine.status()).rss_bytes
    # Pinned while it is measured (however slow this machine is), then let go: its keep-alive
    # counts from its last request.
    await idle_engine.pin(tiny.name, True)
    loaded = await idle_engine.load(tiny.name, str(tiny.path))
    assert loaded.resident_bytes > 10 * 1024**2
    assert loaded.resident_bytes == weight_bytes(tiny.path, "float32")  # the estimate is exact here
    ids, _, _ = await collect(idle_engine, request(tiny, PROMPTS[0], max_tokens=8))
    status = await idle_engine.status()
    held = status.rss_bytes
    model = state_of(status, tiny.name)
    assert model.loaded and model.resident_bytes == loaded.resident_bytes and model.weight_dtype == "float32"
    assert held - before >= loaded.resident_bytes
    await idle_engine.pin(tiny.name, False)
    assert await asyncio.wait_for(heard.get(), 30) == (tiny.name, "idle")  # the engine's own message
    assert not idle_engine.resident(tiny.name)
    gone = await idle_engine.status()
    after = gone.rss_bytes
    assert held - after >= loaded.resident_bytes // 2, (before, held, after, loaded.resident_bytes)
    assert gone.mlx_cache_bytes == 0  # its arrays freed before the cache was cleared
    # The next request loads it again, and generates the same.
    again, _, _ = await collect(idle_engine, request(tiny, PROMPTS[0], max_tokens=8))
    assert again == ids and idle_engine.resident(tiny.name)


async def test_a_pinned_model_survives_idle(
    idle_engine: EngineClient, tiny: ResolvedModel, tiny2: ResolvedModel
) -> None:
    heard = unloads(idle_engine)
    await idle_engine.pin(tiny.name, True)
    await idle_engine.load(tiny.name, str(tiny.path))
    await idle_engine.load(tiny2.name, str(tiny2.path))
    # tiny2 went idle at the same time as tiny: once it is unloaded, tiny's keep-alive has passed too.
    assert await asyncio.wait_for(heard.get(), 30) == (tiny2.name, "idle")
    status = await idle_engine.status()
    pinned = state_of(status, tiny.name)
    assert pinned.loaded and pinned.pinned and pinned.unload_in_secs is None
    assert idle_engine.resident(tiny.name)
    await idle_engine.pin(tiny.name, False)
    assert await asyncio.wait_for(heard.get(), 30) == (tiny.name, "idle")


async def test_a_per_model_keep_alive_of_zero_never_unloads(
    idle_engine: EngineClient, tiny: ResolvedModel, tiny2: ResolvedModel
) -> None:
    heard = unloads(idle_engine)
    await idle_engine.load(tiny.name, str(tiny.path), keep_alive_secs=0)
    await idle_engine.load(tiny2.name, str(tiny2.path))
    assert await asyncio.wait_for(heard.get(), 30) == (tiny2.name, "idle")
    assert state_of(await idle_engine.status(), tiny.name).keep_alive_secs == 0
    assert idle_engine.resident(tiny.name)


async def test_an_operator_unload_cancels_running_requests_when_forced(
    idle_engine: EngineClient, tiny_long: ResolvedModel
) -> None:
    await idle_engine.pin(tiny_long.name, True)  # not idle-unloaded meanwhile
    stream = idle_engine.generate(request(tiny_long, PROMPTS[0], max_tokens=2000))
    assert isinstance(await anext(stream), p.Delta)
    kept = await idle_engine.unload(tiny_long.name)  # busy, not forced: it stays
    assert state_of(kept, tiny_long.name).running == 1
    heard = unloads(idle_engine)
    status = await idle_engine.unload(tiny_long.name, force=True)
    ends = [ev async for ev in stream if isinstance(ev, p.Finished)]
    assert [e.reason for e in ends] == ["cancelled"]
    assert await asyncio.wait_for(heard.get(), 30) == (tiny_long.name, "operator")
    assert not state_of(status, tiny_long.name).loaded


async def test_an_operator_unload_leaves_none_of_the_model_in_mlx(
    idle_engine: EngineClient, tiny: ResolvedModel
) -> None:
    """The model's arrays are freed before MLX's buffer cache is cleared and glibc's heap is
    trimmed (Residency.release_freed): freed after, they stayed in the cache and the heap,
    and the bundled model's unload gave back 27 of its 98 MB (docs/memory.md)."""
    await idle_engine.pin(tiny.name, True)  # not idle-unloaded meanwhile
    before = await idle_engine.status()
    loaded = await idle_engine.load(tiny.name, str(tiny.path))
    await collect(idle_engine, request(tiny, PROMPTS[0], max_tokens=8, logprobs=2))
    held = await idle_engine.status()
    assert held.mlx_active_bytes >= loaded.resident_bytes
    after = await idle_engine.unload(tiny.name)
    assert not state_of(after, tiny.name).loaded
    assert after.mlx_cache_bytes == 0
    # What stays is MLX's own (a random key's few bytes), not a layer of the model's.
    assert after.mlx_active_bytes - before.mlx_active_bytes < (1 << 20) < loaded.resident_bytes


def test_memory_is_released_where_nothing_holds_the_model(tiny: ResolvedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Residency.release_freed (which the engine's loop calls between commands) gives memory
    back after a load (its transients) and after an operator's or an idle unload, each once,
    and only once the model itself is gone: released while a caller still held it, its arrays
    were freed after the trim, into MLX's cache and glibc's heap."""
    from lmspd.engine import residency
    from lmspd.engine.prompt_cache import PromptCache
    from lmspd.engine.requests import Requests

    model: list[weakref.ref[object]] = []
    model_alive_at_release: list[bool] = []
    monkeypatch.setattr(residency, "release_memory", lambda: model_alive_at_release.append(model[-1]() is not None))
    cache = PromptCache(0)
    sent: list[p.Reply] = []
    res = residency.Residency(IDLE, sent.append, cache, Requests(sent.append, cache))
    for unload in ("operator", "idle"):
        res.load_command(p.LoadModel(tiny.name, str(tiny.path)))
        model.append(weakref.ref(res.models[tiny.name].model))
        res.release_freed()  # the load's transients: the model is meant to be alive
        if unload == "operator":
            res.unload(tiny.name, force=False)
        else:
            res.lifecycle.touch(tiny.name, now=0.0)  # last used long ago: its keep-alive has passed
            res.unload_idle()
        assert res.release_due and tiny.name not in res.models
        res.release_freed()
        res.release_freed()  # nothing more is due
    assert model_alive_at_release == [True, False, True, False]
    assert [type(r).__name__ for r in sent].count("ModelEvicted") == 2


def budget_for(*models: ResolvedModel, streams: int = 2, slack: int = 4096) -> int:
    """A memory budget with room for exactly these models (quantized, ``streams`` streams)."""
    config = EngineConfig(weight_dtype="quantized", max_concurrency=streams)
    return sum(estimate_or_zero(m.path, config).total for m in models) + slack


async def test_the_budget_evicts_the_least_recently_used_idle_model(
    tiny: ResolvedModel, tiny2: ResolvedModel, tiny_long: ResolvedModel, smol: ResolvedModel
) -> None:
    # Room for tiny and tiny_long together, not for a third; max_loaded_models would allow all.
    config = EngineConfig(
        weight_dtype="quantized",
        max_concurrency=2,
        max_loaded_models=4,
        max_memory_bytes=budget_for(tiny, tiny_long),
        prompt_cache_max_bytes=0,
    )
    client = EngineClient(config)
    await client.start()
    try:
        heard = unloads(client)
        loaded = await client.load(tiny.name, str(tiny.path))
        assert loaded.resident_bytes == weight_bytes(tiny.path, "quantized")
        await client.load(tiny2.name, str(tiny2.path))
        await collect(client, request(tiny, PROMPTS[0], max_tokens=2))  # tiny is the most recent now
        await client.load(tiny_long.name, str(tiny_long.path))
        assert await asyncio.wait_for(heard.get(), 30) == (tiny2.name, "budget")
        assert sorted(client.loaded) == sorted([tiny.name, tiny_long.name])
        # A model that cannot fit even alone is refused, naming it, its estimate and the budget;
        # nothing is evicted for it.
        with pytest.raises(ModelTooLargeError) as info:
            await collect(client, request(smol, PROMPTS[0], max_tokens=2))
        message = info.value.message
        assert smol.name in message and str(config.max_memory_bytes) in message
        assert str(estimate_or_zero(smol.path, config).total) in message
        assert sorted(client.loaded) == sorted([tiny.name, tiny_long.name]) and heard.empty()
    finally:
        await client.close()


async def test_a_load_waits_for_a_busy_model_to_make_room(tiny: ResolvedModel, tiny_long: ResolvedModel) -> None:
    config = EngineConfig(
        weight_dtype="quantized",
        max_concurrency=2,
        max_loaded_models=4,
        max_memory_bytes=budget_for(tiny_long),  # one model at a time
        prompt_cache_max_bytes=0,
    )
    client = EngineClient(config)
    await client.start()
    try:
        heard = unloads(client)
        stream = client.generate(request(tiny_long, PROMPTS[0], max_tokens=40))
        assert isinstance(await anext(stream), p.Delta)
        load = asyncio.create_task(client.load(tiny.name, str(tiny.path)))
        ends = [ev async for ev in stream if isinstance(ev, p.Finished)]
        assert [e.reason for e in ends] == ["length"]  # the busy model finished undisturbed
        await asyncio.wait_for(load, 30)
        assert await asyncio.wait_for(heard.get(), 30) == (tiny_long.name, "budget")
        assert sorted(client.loaded) == [tiny.name]
    finally:
        await client.close()
