"""cache_write and decode_attend (kernels/decode_block.h): mlx-lm's decode-step attention, bit for bit."""

from __future__ import annotations

import sys
from types import ModuleType

import mlx.core as mx
import pytest

from lmspd.engine import kernels, packed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels are built on Linux only")


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    return kernels.load()


def _reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    keys: mx.array,
    values: mx.array,
    offset: mx.array,
    mask: mx.array | None,
    at: int,
    heads: int,
    dims: int,
    traditional: bool,
    base: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """What mlx-lm's Attention does after its products: reshape, transpose, mx.fast.rope,
    update_and_fetch's slice update and slices, mx.fast.scaled_dot_product_attention."""
    B, kvH = keys.shape[0], keys.shape[1]
    queries = q.reshape(B, 1, heads, -1).transpose(0, 2, 1, 3)
    new_k = k.reshape(B, 1, kvH, -1).transpose(0, 2, 1, 3)
    new_v = v.reshape(B, 1, kvH, -1).transpose(0, 2, 1, 3)
    queries = mx.fast.rope(queries, dims, traditional=traditional, base=base, scale=1.0, offset=offset)
    new_k = mx.fast.rope(new_k, dims, traditional=traditional, base=base, scale=1.0, offset=offset)
    keys = mx.array(keys)
    values = mx.array(values)
    keys[..., at : at + 1, :] = new_k
    values[..., at : at + 1, :] = new_v
    scale = queries.shape[-1] ** -0.5
    out = mx.fast.scaled_dot_product_attention(
        queries, keys[..., : at + 1, :], values[..., : at + 1, :], scale=scale, mask=mask
    )
    return out.transpose(0, 2, 1, 3).reshape(B, 1, -1), keys, values


@pytest.mark.parametrize(("batch", "heads", "kv_heads"), [(1, 9, 3), (3, 9, 3), (2, 4, 4)])
@pytest.mark.parametrize("at", [0, 37, 255])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("traditional", [False, True])
def test_decode_block_computes_mlx_lms_bits(
    ext: ModuleType, batch: int, heads: int, kv_heads: int, at: int, mask_kind: str, traditional: bool
) -> None:
    D, cap, base, dims = 64, 256, 10000.0, 64
    key = mx.random.key(batch * 1000 + at)
    ks = mx.random.split(key, 6)
    q = mx.random.normal((batch, 1, heads * D), key=ks[0])
    k = mx.random.normal((batch, 1, kv_heads * D), key=ks[1])
    v = mx.random.normal((batch, 1, kv_heads * D), key=ks[2])
    keys = mx.random.normal((batch, kv_heads, cap, D), key=ks[3])
    values = mx.random.normal((batch, kv_heads, cap, D), key=ks[4])
    # Left padding, as a BatchKVCache gives: each sequence its own RoPE offset and masked keys.
    padding = mx.array([min(i * 5, at) for i in range(batch)], dtype=mx.int32)
    offset = mx.array(at, dtype=mx.int32) - padding if batch > 1 else mx.array(at, dtype=mx.int32)
    mask: mx.array | None = None
    if mask_kind != "none":
        keep = (mx.arange(at + 1)[None, :] >= padding[:, None])[:, None, None, :]
        mask = keep if mask_kind == "bool" else mx.where(keep, 0.0, -1e9).astype(mx.float32)
    mx.eval(q, k, v, keys, values, offset, mask)
    cos, sin = packed.rope_tables(dims, base, 1.0, 512)
    want = _reference(q, k, v, keys, values, offset, mask, at, heads, dims, traditional, base)
    before = mx.array(keys)
    new_keys = ext.cache_write(k, keys, at, cos, sin, offset, dims, traditional)
    new_values = ext.cache_write(v, values, at)
    out = ext.decode_attend(q, new_keys, new_values, cos, sin, offset, mask, at, D**-0.5, dims, traditional, heads)
    got = (out, new_keys, new_values)
    mx.eval(got, want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and mx.array_equal(g, w).item()
    # This test still holds keys, so cache_write wrote into a copy: the caller's array is unchanged.
    assert mx.array_equal(keys, before).item()


def test_a_cache_nobody_else_holds_is_written_in_place(ext: ModuleType) -> None:
    """The new cache takes over the old one's buffer when MLX says it may, as its own slice
    update does: a decode step copies no cache."""
    D, cap = 64, 256
    cos, sin = packed.rope_tables(D, 10000.0, 1.0, 512)
    q, k, v = mx.ones((1, 1, 3 * D)), mx.ones((1, 1, D)), mx.ones((1, 1, D))
    keys, values = mx.zeros((1, 1, cap, D)) + 0, mx.zeros((1, 1, cap, D)) + 0
    mx.eval(q, k, v, keys, values)
    pointer = _pointer(keys)
    at = mx.array(5, dtype=mx.int32)
    keys = ext.cache_write(k, keys, 5, cos, sin, at, D, False)
    values = ext.cache_write(v, values, 5)
    out = ext.decode_attend(q, keys, values, cos, sin, at, None, 5, D**-0.5, D, False, 3)
    mx.eval(out, keys, values)
    assert _pointer(keys) == pointer
    assert mx.array_equal(values[0, 0, 5], mx.ones(D)).item() and mx.sum(values).item() == D


def _pointer(a: mx.array) -> int:
    import numpy as np

    return int(np.asarray(a, copy=False).__array_interface__["data"][0])


def test_bad_inputs_are_refused(ext: ModuleType) -> None:
    cos, sin = packed.rope_tables(64, 10000.0, 1.0, 16)
    q, kv = mx.ones((1, 1, 192)), mx.ones((1, 1, 64))
    cache = mx.zeros((1, 1, 8, 64))
    at = mx.array(0, dtype=mx.int32)
    with pytest.raises(ValueError, match="inside the cache"):
        ext.cache_write(kv, cache, 8)
    with pytest.raises(ValueError, match="do not match"):
        ext.cache_write(q, cache, 0)
    with pytest.raises(ValueError, match="go together"):
        ext.cache_write(kv, cache, 0, cos)
    with pytest.raises(ValueError, match="inside the caches"):
        ext.decode_attend(q, cache, cache, cos, sin, at, None, 8, 0.125, 64, False, 3)
    with pytest.raises(ValueError, match="do not match"):
        ext.decode_attend(q, cache, cache, cos, sin, at, None, 0, 0.125, 64, False, 2)
    with pytest.raises(ValueError, match="broadcast"):
        ext.decode_attend(q, cache, cache, cos, sin, at, mx.ones((1, 1, 1, 3), mx.bool_), 0, 0.125, 64, False, 3)
    with pytest.raises(ValueError, match="offset"):
        ext.decode_attend(q, cache, cache, cos, sin, mx.array([0, 1], dtype=mx.int32), None, 0, 0.125, 64, False, 3)


def test_an_offset_read_through_its_stride(ext: ModuleType) -> None:
    """A broadcast offset (stride 0) and an unevaluated one give the same bits as one evaluated."""
    D, at = 64, 20
    cos, sin = packed.rope_tables(D, 10000.0, 1.0, 64)
    q = mx.random.normal((3, 1, 2 * D), key=mx.random.key(1))
    k = mx.random.normal((3, 1, D), key=mx.random.key(2))
    cache = mx.random.normal((3, 1, 32, D), key=mx.random.key(3))
    mx.eval(q, k, cache)
    plain = mx.array([at] * 3, dtype=mx.int32)
    for offset in (mx.broadcast_to(mx.array(at, dtype=mx.int32), (3,)), mx.array([at - 1] * 3, dtype=mx.int32) + 1):
        for got, want in (
            (
                ext.cache_write(k, cache, at, cos, sin, offset, D, False),
                ext.cache_write(k, cache, at, cos, sin, plain, D, False),
            ),
            (
                ext.decode_attend(q, cache, cache, cos, sin, offset, None, at, 0.125, D, False, 2),
                ext.decode_attend(q, cache, cache, cos, sin, plain, None, at, 0.125, D, False, 2),
            ),
        ):
            assert mx.array_equal(got, want).item()


def _packed_weight(rows: int, cols: int, seed: int) -> tuple[mx.array, mx.array, mx.array, int, int]:
    """Random weights packed as a model's are: 4 bits, groups of 32, float16 scales and biases."""
    w = (0.05 * mx.random.normal((rows, cols), key=mx.random.key(seed))).astype(mx.float16)
    packed_w, scales, biases = mx.quantize(w, group_size=32, bits=4)
    return packed_w, scales, biases, 32, 4


@pytest.mark.parametrize(("batch", "at"), [(1, 0), (1, 100), (3, 37)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_decode_tail_is_the_four_primitives_it_replaces_bit_for_bit(
    ext: ModuleType, batch: int, at: int, mask_kind: str
) -> None:
    """decode_tail: decode_attend, o_proj with the residual, the norm with gate and up, swiglu
    with down and the second residual, as the four primitives compute them."""
    heads, kv_heads, D, hidden, inner, cap = 9, 3, 64, 576, 1536, 256
    ks = mx.random.split(mx.random.key(batch * 100 + at), 6)
    x = mx.random.normal((batch, 1, hidden), key=ks[0])
    q = mx.random.normal((batch, 1, heads * D), key=ks[1])
    keys = mx.random.normal((batch, kv_heads, cap, D), key=ks[2])
    values = mx.random.normal((batch, kv_heads, cap, D), key=ks[3])
    norm = 1.0 + 0.1 * mx.random.normal((hidden,), key=ks[4])
    padding = mx.array([min(i * 5, at) for i in range(batch)], dtype=mx.int32)
    offset = mx.array(at, dtype=mx.int32) - padding
    mask: mx.array | None = None
    if mask_kind != "none":
        keep = (mx.arange(at + 1)[None, :] >= padding[:, None])[:, None, None, :]
        mask = keep if mask_kind == "bool" else mx.where(keep, 0.0, -1e9).astype(mx.float32)
    o_proj, gate_up = _packed_weight(hidden, heads * D, 1), _packed_weight(2 * inner, hidden, 2)
    down = _packed_weight(hidden, inner, 3)
    mx.eval(x, q, keys, values, norm, offset, mask, o_proj, gate_up, down)
    cos, sin = packed.rope_tables(D, 10000.0, 1.0, 512)
    scale, eps = D**-0.5, 1e-5

    attended = ext.decode_attend(q, keys, values, cos, sin, offset, mask, at, scale, D, False, heads)
    h = ext.quantized_matvec(attended, *o_proj, residual=x)
    gate, up = ext.quantized_matvecs(h, *gate_up, [inner, inner], norm=norm, eps=eps)
    want = ext.quantized_matvec(gate, *down, up=up, residual=h)
    got = ext.decode_tail(
        q,
        keys,
        values,
        cos,
        sin,
        offset,
        mask,
        at,
        scale,
        D,
        False,
        heads,
        x,
        *o_proj,
        norm,
        eps,
        *gate_up,
        [inner, inner],
        *down,
    )
    mx.eval(got, want)
    assert got.shape == want.shape == (batch, 1, hidden)
    assert mx.array_equal(got, want).item()


def test_decode_tail_refuses_what_does_not_fit(ext: ModuleType) -> None:
    cos, sin = packed.rope_tables(64, 10000.0, 1.0, 16)
    q, x = mx.ones((1, 1, 192)), mx.ones((1, 1, 64))
    cache = mx.zeros((1, 1, 8, 64))
    at = mx.array(0, dtype=mx.int32)
    o_proj, gate_up, down = _packed_weight(64, 192, 1), _packed_weight(256, 64, 2), _packed_weight(64, 128, 3)

    def tail(widths: list[int], x: mx.array = x, o: tuple[mx.array, mx.array, mx.array, int, int] = o_proj) -> None:
        ext.decode_tail(
            q,
            cache,
            cache,
            cos,
            sin,
            at,
            None,
            0,
            0.125,
            64,
            False,
            3,
            x,
            *o,
            mx.ones(64),
            1e-5,
            *gate_up,
            widths,
            *down,
        )

    with pytest.raises(ValueError, match="two equal widths"):
        tail([100, 156])
    with pytest.raises(ValueError, match="x must be"):
        tail([128, 128], x=mx.ones((2, 1, 64)))
    with pytest.raises(ValueError, match="o_proj"):
        tail([128, 128], o=_packed_weight(64, 128, 4))
