"""A decode step's attention layer in lmspd's kernels, for mlx-lm's Llama attention.

After its q/k/v products, mlx-lm's ``Attention.__call__`` (models/llama.py) spends fifteen
primitives on one new position per sequence: reshapes, transposes, RoPE on q and k, the KV
cache's slice updates and slices, the attention, a transpose and a reshape. Three primitives
of lmspd's (kernels/decode_block.h) do it with the same arithmetic and so the same bits
(tests/engine/test_decode_block.py): ``cache_write`` for k (with its RoPE) and for v, each
writing into the cache's buffer, and ``decode_attend``.

``install`` gives each ``llama.Attention`` of a packed model this class (only the class
changes: parameters, names and the cache stay mlx-lm's), and ``__call__`` takes a decode step
only when every condition of that equality holds; anything else (a prompt, a cache about to
grow, another cache kind, another dtype) is mlx-lm's own code. The RoPE must be packed's
TableRoPE, known here by its tables (``_cos``, ``_sin``): this package imports nothing of lmspd's.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as caches
from mlx_lm.models import llama


class DecodeBlockAttention(llama.Attention):  # type: ignore[misc]  # mlx-lm is untyped
    """llama.Attention with its decode step in three primitives (the module docstring)."""

    _kernels: ModuleType  # lmspd's kernels (cache_write, decode_attend)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        inputs = self._block_inputs(x, mask, cache)
        if inputs is None:
            result: mx.array = super().__call__(x, mask=mask, cache=cache)
            return result
        at, offset, m = inputs
        rope = self.rope
        ext = self._kernels
        tables = (rope._cos, rope._sin, offset)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        cache.keys = ext.cache_write(k, cache.keys, at, *tables, rope.dims, rope.traditional)
        cache.values = ext.cache_write(v, cache.values, at)
        out = ext.decode_attend(
            q, cache.keys, cache.values, *tables, m, at, self.scale, rope.dims, rope.traditional, self.n_heads
        )
        # As update_and_fetch advances them, after the RoPE read the offset.
        if type(cache) is caches.BatchKVCache:
            cache.offset = cache.offset + 1
            cache._idx += 1
        else:
            cache.offset += 1
        projected: mx.array = self.o_proj(out)
        return projected

    def _block_inputs(self, x: mx.array, mask: Any, cache: Any) -> tuple[int, mx.array, mx.array | None] | None:
        """(the new position's index in the cache, RoPE's offset, the mask), or None where
        decode_block would not compute what mlx-lm's code does."""
        if x.ndim != 3 or x.shape[1] != 1 or x.dtype != mx.float32 or not _table_rope(self.rope):
            return None
        kind = type(cache)
        if kind not in (caches.KVCache, caches.BatchKVCache) or cache.keys is None:
            return None
        keys, values = cache.keys, cache.values
        if keys.dtype != mx.float32 or values.dtype != mx.float32 or keys.ndim != 4:
            return None
        positions = self.rope._cos.shape[0]
        if kind is caches.BatchKVCache:
            at = cache._idx
            offset = cache.offset
            if not isinstance(offset, mx.array) or offset.dtype != mx.int32 or offset.ndim > 1:
                return None
        else:
            at = cache.offset
            if not isinstance(at, int) or not 0 <= at < positions:
                return None
            offset = mx.array(at, dtype=mx.int32)
        if at + 1 > keys.shape[2]:  # the cache grows: mlx-lm's update_and_fetch does that
            return None
        m = None if mask is None or isinstance(mask, str) else mask  # one query row: "causal" masks nothing
        if m is not None and not (
            isinstance(m, mx.array) and m.dtype in (mx.bool_, mx.float32) and m.ndim <= 4 and m.shape[-1] in (1, at + 1)
        ):
            return None
        return at, offset, m


def _table_rope(rope: Any) -> bool:
    """Whether rope is packed.TableRoPE (its tables of every position's cos and sin)."""
    return isinstance(getattr(rope, "_cos", None), mx.array) and isinstance(getattr(rope, "_sin", None), mx.array)


def install(model: nn.Module, ext: ModuleType) -> int:
    """Give the model's llama.Attention modules DecodeBlockAttention's decode step (after
    packed.pack, whose TableRoPE it needs); the number of layers that took it."""
    taken = 0
    for _, module in model.named_modules():
        if type(module) is llama.Attention and _table_rope(module.rope):
            module.__class__ = DecodeBlockAttention
            module._kernels = ext
            taken += 1
    return taken
