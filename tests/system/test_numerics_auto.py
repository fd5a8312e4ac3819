"""``[engine] numerics = "auto"`` per model (docs/numerics.md, "What auto runs"): a model of
256 MiB of weights or more runs the fast path, a smaller one the exact path, and loaded together
in one engine each keeps its own (the kernels' setting is the process's, set before each model's
step). The large model is a random 24-layer Llama (harness.models.LAYERED, 324 MiB)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harness.generation import PROMPTS, collect, request
from harness.models import LAYERED, make_tiny_model
from lmspd.config import EngineConfig, NumericsSetting
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ResolvedModel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    path = make_tiny_model(tmp_path_factory.mktemp("layered") / "layered", smol_dir, shape=LAYERED, context=512)
    return ResolvedModel(name="layered", path=path)


async def _answers(numerics: NumericsSetting, *models: ResolvedModel) -> tuple[dict[str, list[list[int]]], list[str]]:
    """Each model's greedy answers to two prompts, the models' streams at once (one each at a
    time: a prompt prefilled with another's rows would go through BLAS in another shape, which
    is not what this compares); each model's numerics."""
    engine = EngineClient(EngineConfig(numerics=numerics, max_loaded_models=2, prompt_cache_max_bytes=0))
    await engine.start()
    try:
        loaded = {m.name: await engine.load(m.name, str(m.path)) for m in models}
        answers: dict[str, list[list[int]]] = {m.name: [] for m in models}
        for q in PROMPTS[:2]:
            got = await asyncio.gather(*(collect(engine, request(m, q, max_tokens=24)) for m in models))
            for m, (ids, _, _) in zip(models, got, strict=True):
                answers[m.name].append(ids)
        return answers, [loaded[m.name].numerics for m in models]
    finally:
        await engine.close()


async def test_auto_runs_each_model_on_its_own_path_side_by_side(tiny: ResolvedModel, layered: ResolvedModel) -> None:
    together, numerics = await _answers("auto", tiny, layered)
    assert numerics == ["exact", "fast"]
    assert together["tiny"] == (await _answers("exact", tiny))[0]["tiny"]
    assert together["layered"] == (await _answers("fast", layered))[0]["layered"]
    # The two paths differ on the large model, so the comparison above means something.
    assert together["layered"] != (await _answers("exact", layered))[0]["layered"]
