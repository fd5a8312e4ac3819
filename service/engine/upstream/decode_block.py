"""A decode step's attention layer in lmspd's kernels, for mlx-lm's Llama attention.

After its q/k/v products, mlx-lm's ``Attention.__call__`` (models/llama.py) spends fifteen
primitives on one new position per sequence: reshapes, transposes, RoPE on q and k, the KV
cache's slice updates and slices, the attention, a transpose and a reshape. Three primitives
of lmspd's (kernels/decode_block.h) do it with the same arithmetic and so the same bits
(tests/engine/test_decode_block.py): ``cache_write`` for k (with its RoPE) and for v, each
writing into the cache's buffer, and ``decode_attend``.

``install`` gives each ``llama.Attention`` of a packed model this class (only the class changes:
parameters, names and the cache stay mlx-lm's), and each ``llama.TransformerBlock`` around one
``DecodeBlock``, which folds the block's norms, residual adds and swiglu into its products;
``__call__`` takes a decode step only when every condition of that equality holds; anything else
(a prompt, a cache about to grow, another cache kind, another dtype) is mlx-lm's own code. The
RoPE must be packed's TableRoPE, known here by its tables (``_cos``, ``_sin``): this package
imports nothing of lmspd's.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as caches
from mlx_lm.models import llama


@dataclass(frozen=True, slots=True)
class _Rope:
    """A DecodeBlockAttention's TableRoPE as its step reads it, gathered once by ``install``."""

    cos: mx.array
    sin: mx.array
    dims: int
    traditional: bool


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a DecodeBlock's step reads of its modules, gathered once by ``install``. Each read
    of an nn.Module's array or child goes through ``Module.__getattr__`` (a dict lookup after a
    failed attribute lookup): ~30 a layer, 900 a step, a fifth of the step's graph construction,
    which runs while the kernels wait (docs/benchmarks.md, "Sixth pass"). The weights are those
    the model holds at install: ``install`` runs last, after packing."""

    attn: DecodeBlockAttention
    qkv: tuple[mx.array, mx.array, mx.array, int, int]
    qkv_widths: list[int]
    before: mx.array
    before_eps: float
    o_proj: tuple[mx.array, mx.array, mx.array, int, int]
    gate_up: tuple[mx.array, mx.array, mx.array, int, int]
    gate_up_widths: list[int]
    after: mx.array
    after_eps: float
    down_proj: tuple[mx.array, mx.array, mx.array, int, int]
    rows: int  # the most rows of x both o_proj's and down_proj's kernels take


class DecodeBlockAttention(llama.Attention):  # type: ignore[misc]  # mlx-lm is untyped
    """llama.Attention with its decode step in three primitives (the module docstring)."""

    _kernels: ModuleType  # lmspd's kernels (cache_write, decode_attend)
    _rope: _Rope

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        inputs = self._block_inputs(x, mask, cache)
        if inputs is None:
            result: mx.array = super().__call__(x, mask=mask, cache=cache)
            return result
        projected: mx.array = self.o_proj(self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), inputs, cache))
        return projected

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, inputs: tuple[int, mx.array, mx.array | None], cache: Any
    ) -> mx.array:
        """The new position's k and v written into the cache, then the attention of q over it:
        (B, 1, heads * Dv), before o_proj. ``inputs``: what _block_inputs said."""
        out: mx.array = self._kernels.decode_attend(*self.written(q, k, v, inputs, cache))
        advance(cache)
        return out

    def written(
        self, q: mx.array, k: mx.array, v: mx.array, inputs: tuple[int, mx.array, mx.array | None], cache: Any
    ) -> tuple[Any, ...]:
        """k and v written into the cache; then decode_attend's arguments (decode_tail's first
        twelve): q over the cache's first at + 1 positions."""
        at, offset, m = inputs
        rope, ext = self._rope, self._kernels
        cache.keys = ext.cache_write(k, cache.keys, at, rope.cos, rope.sin, offset, rope.dims, rope.traditional)
        cache.values = ext.cache_write(v, cache.values, at)
        return (
            q,
            cache.keys,
            cache.values,
            rope.cos,
            rope.sin,
            offset,
            m,
            at,
            self.scale,
            rope.dims,
            rope.traditional,
            self.n_heads,
        )

    def _block_inputs(self, x: mx.array, mask: Any, cache: Any) -> tuple[int, mx.array, mx.array | None] | None:
        """(the new position's index in the cache, RoPE's offset, the mask), or None where
        decode_block would not compute what mlx-lm's code does."""
        if x.ndim != 3 or x.shape[1] != 1 or x.dtype != mx.float32:
            return None
        kind = type(cache)
        if kind not in (caches.KVCache, caches.BatchKVCache) or cache.keys is None:
            return None
        keys, values = cache.keys, cache.values
        if keys.dtype != mx.float32 or values.dtype != mx.float32 or keys.ndim != 4:
            return None
        positions = self._rope.cos.shape[0]
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


class DecodeBlock(llama.TransformerBlock):  # type: ignore[misc]  # mlx-lm is untyped
    """llama.TransformerBlock whose decode step is four primitives where it was twelve: the
    input norm inside the q/k/v product (``quantized_matvecs`` with ``norm``), the two cache
    writes, and ``decode_tail``: the attention, o_proj with the residual add, the
    post-attention norm with the gate/up product, and swiglu, down_proj and the second residual
    add. Each the same arithmetic as the primitives it replaces, so the same bits
    (tests/engine/test_weights.py), and fewer for MLX to dispatch, which on two cores takes the
    CPU the kernels would use (docs/benchmarks.md, "Fourth pass" and "Sixth pass"). Anything
    DecodeBlockAttention would not take, or a layer not packed as these need, is mlx-lm's own
    code."""

    _plan: _Plan

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        plan = self._plan
        attn = plan.attn
        inputs = attn._block_inputs(x, mask, cache) if self._fusable(x, plan) else None
        if inputs is None:
            result: mx.array = super().__call__(x, mask=mask, cache=cache)
            return result
        ext = attn._kernels
        q, k, v = ext.quantized_matvecs(x, *plan.qkv, plan.qkv_widths, norm=plan.before, eps=plan.before_eps)
        out: mx.array = ext.decode_tail(
            *attn.written(q, k, v, inputs, cache),
            x,
            *plan.o_proj,
            plan.after,
            plan.after_eps,
            *plan.gate_up,
            plan.gate_up_widths,
            *plan.down_proj,
        )
        advance(cache)
        return out

    @staticmethod
    def _fusable(x: mx.array, plan: _Plan) -> bool:
        return (
            type(plan.attn) is DecodeBlockAttention
            and x.dtype == mx.float32
            and x.ndim == 3
            and x.shape[1] == 1
            and x.shape[0] <= plan.rows
        )


def advance(cache: Any) -> None:
    """The cache's position advanced past the one written, as update_and_fetch advances it
    (after the step's RoPE read the offset)."""
    if type(cache) is caches.BatchKVCache:
        cache.offset = cache.offset + 1
        cache._idx += 1
    else:
        cache.offset += 1


def _packed(layer: Any) -> tuple[mx.array, mx.array, mx.array, int, int]:
    """A packed layer's (or stacked siblings') weights, scales, biases, group size and bits."""
    return layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits


def _block_takes(block: Any) -> bool:
    """Whether a llama.TransformerBlock is packed as DecodeBlock needs: DecodeBlockAttention;
    RMSNorms with float32 weights (packed.FusedRMSNorm, or nn.RMSNorm: the same bits); q, k, v
    and gate, up each one set of stacked siblings in that order (packed.Siblings); o_proj and
    down_proj packed; no biases."""
    attn, mlp = block.self_attn, block.mlp

    def siblings(*layers: Any) -> bool:
        s = getattr(layers[0], "_siblings", None)
        return (
            s is not None
            and all(
                getattr(m, "_siblings", None) is s and m._index == i and "bias" not in m for i, m in enumerate(layers)
            )
            and len(s.widths) == len(layers)
        )

    def packed(layer: Any) -> bool:
        return all(hasattr(layer, a) for a in ("scales", "biases", "_kernel_rows")) and "bias" not in layer

    def norm(n: Any) -> bool:
        w = getattr(n, "weight", None)
        return isinstance(w, mx.array) and w.dtype == mx.float32 and w.ndim == 1 and isinstance(n.eps, float)

    return (
        type(attn) is DecodeBlockAttention
        and type(block.mlp) is llama.MLP
        and siblings(attn.q_proj, attn.k_proj, attn.v_proj)
        and siblings(mlp.gate_proj, mlp.up_proj)
        and packed(attn.o_proj)
        and packed(mlp.down_proj)
        and norm(block.input_layernorm)
        and norm(block.post_attention_layernorm)
    )


def _table_rope(rope: Any) -> bool:
    """Whether rope is packed.TableRoPE (its tables of every position's cos and sin)."""
    return isinstance(getattr(rope, "_cos", None), mx.array) and isinstance(getattr(rope, "_sin", None), mx.array)


def install(model: nn.Module, ext: ModuleType) -> int:
    """Give the model's llama.Attention modules DecodeBlockAttention's decode step (after
    packed.pack, whose TableRoPE it needs); the number of layers that took it."""
    taken = 0
    for _, module in model.named_modules():
        if type(module) is llama.Attention and _table_rope(module.rope):
            rope = module.rope
            module.__class__ = DecodeBlockAttention
            module._kernels = ext
            module._rope = _Rope(rope._cos, rope._sin, rope.dims, rope.traditional)
            taken += 1
    for _, module in model.named_modules():
        if type(module) is llama.TransformerBlock and _block_takes(module):
            module.__class__ = DecodeBlock
            module._plan = _plan(module)
    return taken


def _plan(block: Any) -> _Plan:
    attn, mlp = block.self_attn, block.mlp
    qkv, gate_up = attn.q_proj._siblings, mlp.gate_proj._siblings
    before, after = block.input_layernorm, block.post_attention_layernorm
    return _Plan(
        attn=attn,
        qkv=_packed(qkv),
        qkv_widths=qkv.widths,
        before=before.weight,
        before_eps=before.eps,
        o_proj=_packed(attn.o_proj),
        gate_up=_packed(gate_up),
        gate_up_widths=gate_up.widths,
        after=after.weight,
        after_eps=after.eps,
        down_proj=_packed(mlp.down_proj),
        rows=min(attn.o_proj._kernel_rows, mlp.down_proj._kernel_rows),
    )
