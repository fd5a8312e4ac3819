"""``StepNow`` (engine/upstream/stepping.py) against mlx-lm's own ``GenerationBatch``, in one
process on the tiny model: the same greedy tokens for requests that join a running batch at
different steps, a first token after one forward pass instead of two, and no pass after a
request's last token."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
from mlx_lm.utils import load_model

from lmspd.engine.upstream import stepping
from lmspd.models.registry import ResolvedModel

generate = importlib.import_module("mlx_lm.generate")
PROMPTS = [[1, 9690, 198, 2683, 2988], [1, 33, 44, 55, 66, 77, 88, 99, 11], [1, 250, 251]]


class Counting:
    """The model, its forward passes counted (BatchGenerator calls it like the model)."""

    def __init__(self, model: Any) -> None:
        self.model, self.calls = model, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def model(tiny: ResolvedModel) -> Counting:
    return Counting(load_model(tiny.path)[0])


@pytest.fixture(params=["upstream", "step_now"])
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "step_now":
        monkeypatch.setattr(generate, "GenerationBatch", stepping.StepNow)
    yield request.param


def run(model: Counting, joins: list[int], max_tokens: int) -> dict[int, list[int]]:
    """Greedy tokens per request; request i is inserted before step ``joins[i]``."""
    gen = generate.BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    out: dict[int, list[int]] = {}
    uid_of: dict[int, int] = {}
    step = 0
    try:
        while len(uid_of) < len(joins) or any(len(out.get(u, [])) < max_tokens for u in uid_of.values()):
            for i, at in enumerate(joins):
                if at == step:
                    (uid_of[i],) = gen.insert([PROMPTS[i]], max_tokens=[max_tokens])
            for r in gen.next()[1]:
                out.setdefault(r.uid, []).append(r.token)
            step += 1
            assert step < 200, "the batch did not finish"
    finally:
        gen.close()
    return {i: out[u] for i, u in uid_of.items()}


def test_greedy_tokens_are_the_upstream_ones_for_requests_joining_at_any_step(
    model: Counting, monkeypatch: pytest.MonkeyPatch
) -> None:
    for joins in ([0, 0, 0], [0, 3, 5], [0, 1, 9]):
        upstream = run(model, joins, 12)
        with monkeypatch.context() as m:
            m.setattr(generate, "GenerationBatch", stepping.StepNow)
            now = run(model, joins, 12)
        assert now == upstream, joins


def test_a_first_token_after_one_pass_and_none_after_the_last(model: Counting, kind: str) -> None:
    gen = generate.BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    try:
        gen.insert([PROMPTS[0]], max_tokens=[3])
        model.calls = 0
        first_after: int | None = None
        finished = False
        while not finished:
            responses = gen.next()[1]
            if responses and first_after is None:
                first_after = model.calls
            finished = any(r.finish_reason is not None for r in responses)
        passes = model.calls
    finally:
        gen.close()
    # One prefill pass over the prompt but its last token; that token's pass gives the first
    # token, and the passes over the first and second give the second and third. Upstream
    # has started the pass over token 1 before it hands token 1 out, and runs one over the
    # third, whose result nobody reads.
    assert (first_after, passes) == ((2, 4) if kind == "step_now" else (3, 5))
