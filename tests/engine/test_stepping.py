"""``StepNow`` (engine/upstream/stepping.py) against mlx-lm's own ``GenerationBatch``, in one
process on the tiny model: the same greedy tokens for requests that join a running batch at
different steps (the batch running a pass ahead meanwhile, and giving it up before they join),
a first token after one forward pass instead of two, no pass after a request's last token, and
a request taken out while a pass runs ahead leaving a cache that holds exactly its tokens."""

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


def step_now(m: pytest.MonkeyPatch) -> None:
    """What ``stepping.install`` does, undone with ``m``."""
    m.setattr(generate, "GenerationBatch", stepping.StepNow)
    m.setattr(generate.BatchGenerator, "_next", stepping._next)


@pytest.fixture(params=["upstream", "step_now"])
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "step_now":
        step_now(monkeypatch)
    yield request.param


def run(model: Counting, joins: list[int], max_tokens: int) -> tuple[dict[int, list[int]], int]:
    """Greedy tokens per request, request i inserted before step ``joins[i]``; and the steps
    after which the batch ran a pass ahead."""
    gen = generate.BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    out: dict[int, list[int]] = {}
    uid_of: dict[int, int] = {}
    step = ahead = 0
    try:
        while len(uid_of) < len(joins) or any(len(out.get(u, [])) < max_tokens for u in uid_of.values()):
            for i, at in enumerate(joins):
                if at == step:
                    (uid_of[i],) = gen.insert([PROMPTS[i]], max_tokens=[max_tokens])
            for r in gen.next()[1]:
                out.setdefault(r.uid, []).append(r.token)
            ahead += bool(getattr(gen._generation_batch, "_ahead", False))
            step += 1
            assert step < 200, "the batch did not finish"
    finally:
        gen.close()
    return {i: out[u] for i, u in uid_of.items()}, ahead


def test_greedy_tokens_are_the_upstream_ones_for_requests_joining_at_any_step(
    model: Counting, monkeypatch: pytest.MonkeyPatch
) -> None:
    for joins in ([0, 0, 0], [0, 3, 5], [0, 1, 9], [0, 12, 20]):
        upstream, _ = run(model, joins, 16)
        with monkeypatch.context() as m:
            step_now(m)
            now, ahead = run(model, joins, 16)
        assert now == upstream, joins
        # Settled between joins, the batch ran ahead (and gave it up for each join: extend()
        # refuses a batch that is ahead, so a join it had not given up for fails the run).
        assert ahead >= 8, (joins, ahead)


def test_logits_processors_keep_every_step_waiting_for_its_own_pass(
    model: Counting, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []

    def processor(tokens: Any, logits: Any) -> Any:
        seen.append(int(tokens[-1].item()))  # needs the last token's value: no pass ahead
        return logits

    step_now(monkeypatch)
    gen = generate.BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    try:
        gen.insert([PROMPTS[0]], max_tokens=[12], logits_processors=[[processor]])
        out: list[int] = []
        while len(out) < 12:
            out += [r.token for r in gen.next()[1]]
            assert not getattr(gen._generation_batch, "_ahead", False)
    finally:
        gen.close()
    assert seen[1:] == out[:-1]  # each pass's processor saw the token handed out before it


def test_a_request_taken_out_while_ahead_keeps_a_cache_of_exactly_its_tokens(
    model: Counting, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_now(monkeypatch)
    gen = generate.BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    try:
        one, two = gen.insert([PROMPTS[0], PROMPTS[1]], max_tokens=[40, 40])
        out: dict[int, list[int]] = {one: [], two: []}
        while len(out[one]) < 10:
            for r in gen.next()[1]:
                out[r.uid].append(r.token)
        assert gen._generation_batch._ahead
        cache, tokens = gen.remove([one], return_prompt_caches=True)[one]
        # Every token the model has seen, in order, and its KV: the pass in flight took the
        # last one handed out.
        assert tokens == PROMPTS[0] + out[one]
        assert all(c.offset == len(tokens) for c in cache)
        while len(out[two]) < 40:
            for r in gen.next()[1]:
                out[r.uid].append(r.token)
    finally:
        gen.close()
    with monkeypatch.context() as m:  # upstream's classes: the other request's tokens
        m.setattr(generate, "GenerationBatch", stepping._Upstream)
        m.setattr(generate.BatchGenerator, "_next", stepping._upstream_next)
        upstream, _ = run(model, [0, 0], 40)
    assert out[two] == upstream[1]


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
    # token, and the passes over the first and second give the second and third (the latter
    # started ahead, and none after it: the third is the last). Upstream
    # has started the pass over token 1 before it hands token 1 out, and runs one over the
    # third, whose result nobody reads.
    assert (first_after, passes) == ((2, 4) if kind == "step_now" else (3, 5))
