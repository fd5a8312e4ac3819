"""upstream/batch_cache.py: a merged batch's KV cache has room for its next position, so a
request whose prompt came from the prompt cache takes lmspd's decode block on its first step,
with the same tokens and logprobs, bit for bit, as with mlx-lm's merge."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
from mlx_lm.utils import load_model

from lmspd.engine.upstream import batch_cache, decode_block
from lmspd.engine.weights import apply_weight_dtype
from lmspd.models.registry import ResolvedModel

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels are built on Linux only")


@pytest.fixture
def ours() -> Iterator[None]:
    batch_cache.install()
    try:
        yield
    finally:
        batch_cache.uninstall()


def _kv(n: int, seed: int) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, 3, n, 8), key=mx.random.key(seed))
    c.update_and_fetch(k, k + 1)
    return c


def test_a_merged_batch_has_room_and_holds_what_upstreams_holds(ours: None) -> None:
    for lengths in ((39,), (39, 10), (256, 3), (255,)):
        batch = [_kv(n, i) for i, n in enumerate(lengths)]
        got = BatchKVCache.merge(batch)
        batch_cache.uninstall()
        want = BatchKVCache.merge(batch)
        batch_cache.install()
        held = max(lengths)
        assert want.keys.shape[2] == held  # upstream's: no room
        assert got.keys.shape[2] == (held // 256 + 1) * 256 > held
        assert got._idx == want._idx == held
        for a, b in ((got.offset, want.offset), (got.left_padding, want.left_padding)):
            assert mx.array_equal(a, b).item()
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            assert mx.array_equal(a[..., :held, :], b).item() and not mx.any(a[..., held:, :]).item()
    empty = BatchKVCache.merge([KVCache(), KVCache()])
    assert empty.keys is None and empty.offset.tolist() == [0, 0]


def test_cached_prompts_first_steps_take_the_decode_block_with_the_same_bits(
    tiny: ResolvedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests whose prompts come from a prompt cache (all but the last token cached, and a
    shorter prefix), joining a running batch: with room, every decode step runs lmspd's
    decode block; the tokens and logprobs are those of mlx-lm's merge."""
    model, _ = load_model(tiny.path)
    apply_weight_dtype(model, "quantized_float32")
    prompts = [[(5 * i + j) % 700 + 3 for j in range(n)] for i, n in enumerate((40, 23, 61))]
    cached = []
    for p, keep in zip(prompts, (39, 23 - 5, 60), strict=True):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(p[:keep])[None], cache=cache), [c.state for c in cache])
        cached.append((p, keep, cache))
    calls = {"decode block": 0, "mlx-lm": 0}
    upstream_inputs = decode_block.DecodeBlockAttention._block_inputs

    def counted(self: Any, x: mx.array, mask: Any, cache: Any) -> Any:
        got = upstream_inputs(self, x, mask, cache)
        if x.shape[1] == 1:
            calls["decode block" if got is not None else "mlx-lm"] += 1
        return got

    def run() -> list[tuple[int, int, mx.array]]:
        calls.update({"decode block": 0, "mlx-lm": 0})
        gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
        out: list[tuple[int, int, mx.array]] = []
        for i, (p, keep, cache) in enumerate(cached):
            copies = [KVCache() for _ in cache]
            for c, h in zip(copies, cache, strict=True):
                c.keys, c.values, c.offset = h.keys[..., :keep, :] + 0, h.values[..., :keep, :] + 0, keep
            gen.insert([p[keep:]], max_tokens=[10], caches=[copies], all_tokens=[p[:keep]])
            for _ in range(3 * i + 1):
                out += [(r.uid, r.token, r.logprobs) for r in gen.next_generated()]
        while len(out) < 30:
            out += [(r.uid, r.token, r.logprobs) for r in gen.next_generated()]
        gen.close()
        return out

    monkeypatch.setattr(decode_block.DecodeBlockAttention, "_block_inputs", counted)
    want = run()
    upstream_calls = dict(calls)
    batch_cache.install()
    try:
        got = run()
    finally:
        batch_cache.uninstall()
    assert upstream_calls["mlx-lm"] > 0  # upstream's merge: first steps without room
    assert calls["mlx-lm"] == 0 and calls["decode block"] > 0
    assert [(u, t) for u, t, _ in got] == [(u, t) for u, t, _ in want]
    assert all(mx.array_equal(g, w).item() for (_, _, g), (_, _, w) in zip(got, want, strict=True))
