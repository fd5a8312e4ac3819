"""upstream/prompt_batch.py: prompts whose prefill is done move to generation without a copy
of the batch's KV cache when the whole batch moves, and the tokens and logprobs are mlx-lm's."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from lmspd.engine.upstream import prompt_batch
from lmspd.engine.weights import apply_weight_dtype
from lmspd.models.registry import ResolvedModel

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels are built on Linux only")


@pytest.fixture
def ours() -> Iterator[None]:
    prompt_batch.install()
    try:
        yield
    finally:
        prompt_batch.uninstall()


def test_a_whole_batch_moves_without_a_copy_and_leaves_an_empty_one(tiny: ResolvedModel, ours: None) -> None:
    model, _ = load_model(tiny.path)
    caches = [make_prompt_cache(model) for _ in range(2)]
    batch = PromptProcessingBatch(model, [7, 8], caches, tokens=[[], []], max_tokens=[5, 6])
    batch.prompt([[3, 4, 5], [6, 7]])
    held = list(batch.prompt_cache)
    moved = batch.split([1, 0])
    assert moved.uids == [7, 8] and moved.max_tokens == [5, 6]
    assert all(a is b for a, b in zip(moved.prompt_cache, held, strict=True))  # not copied
    assert batch.uids == [] and batch.prompt_cache == [] and batch.tokens == [] and len(batch) == 0
    assert moved.tokens == [[3, 4, 5], [6, 7]]
    # The empty batch takes new prompts as upstream's filter([]) leaves it able to.
    batch.extend(PromptProcessingBatch(model, [9], [make_prompt_cache(model)], tokens=[[]], max_tokens=[4]))
    assert batch.uids == [9] and len(batch.prompt_cache) == len(held)


def test_part_of_a_batch_is_upstreams_split(tiny: ResolvedModel, ours: None) -> None:
    model, _ = load_model(tiny.path)
    caches = [make_prompt_cache(model) for _ in range(3)]
    batch = PromptProcessingBatch(
        model,
        [1, 2, 3],
        caches,
        tokens=[[], [], []],
        samplers=[None] * 3,
        logits_processors=[[]] * 3,
        max_tokens=[4] * 3,
    )
    batch.prompt([[3, 4], [5, 6], [7, 8]])
    held = list(batch.prompt_cache)
    moved = batch.split([1])
    assert moved.uids == [2] and batch.uids == [1, 3]
    assert all(a is not b for a, b in zip(moved.prompt_cache, held, strict=True))  # upstream copies


def test_generation_is_upstreams_token_for_token(tiny: ResolvedModel) -> None:
    """Prompts joining a running batch one by one, several at once, and a long one prefilled
    over several steps beside short ones (part of the prompt batch moves first): the same
    tokens and logprobs, bit for bit, with and without the hand-over."""
    model, _ = load_model(tiny.path)
    apply_weight_dtype(model, "quantized_float32")
    prompts = [[(7 * i + 3 * j) % 800 + 3 for j in range(n)] for i, n in enumerate((12, 40, 9, 70, 15))]

    def run() -> list[tuple[int, int, mx.array]]:
        gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=16)
        out: list[tuple[int, int, mx.array]] = []
        gen.insert([prompts[0]], max_tokens=[12])
        for _ in range(3):
            out += [(r.uid, r.token, r.logprobs) for r in gen.next()[1]]
        gen.insert(prompts[1:4], max_tokens=[12, 12, 12])  # together; the 70-token one takes 5 steps
        for _ in range(2):
            out += [(r.uid, r.token, r.logprobs) for r in gen.next()[1]]
        gen.insert([prompts[4]], max_tokens=[12])
        while len(out) < 60:
            out += [(r.uid, r.token, r.logprobs) for r in gen.next()[1]]
        gen.close()
        return out

    want = run()
    calls: list[bool] = []
    upstream = prompt_batch._upstream_split

    def counted(self: PromptProcessingBatch, indices: list[int]) -> PromptProcessingBatch:
        calls.append(sorted(indices) == list(range(len(self.uids))))
        return prompt_batch.split(self, indices)

    PromptProcessingBatch.split = counted
    try:
        got = run()
    finally:
        PromptProcessingBatch.split = upstream
    assert True in calls and False in calls  # both kinds of split happened
    assert [(u, t) for u, t, _ in got] == [(u, t) for u, t, _ in want]
    assert all(mx.array_equal(g, w).item() for (_, _, g), (_, _, w) in zip(got, want, strict=True))
