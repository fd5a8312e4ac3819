"""The fast path's products (kernels/q8.h, docs/numerics.md): 8-bit activations, the same bits
on every kernel and in every batch, and the arithmetic the documents say."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

from lmspd.engine import kernels
from lmspd.engine.weights import AUTO_FAST_BYTES, resolve_numerics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels are built on Linux only")


@pytest.fixture
def ext() -> Iterator[ModuleType]:
    """The kernels with numerics = "fast" for the test (the setting is the process's)."""
    ext = kernels.load()
    ext.set_numerics("fast")
    yield ext
    ext.set_numerics("exact")


def _quantized(rows: int, cols: int, group: int, bits: int, dtype: mx.Dtype) -> tuple[mx.array, ...]:
    w = (mx.random.normal((rows, cols), key=mx.random.key(rows + cols + bits)) * 0.2).astype(dtype)
    return tuple(mx.quantize(w, group, bits))


def _reference(x: mx.array, q: mx.array, s: mx.array, b: mx.array, group: int) -> np.ndarray:
    """docs/numerics.md's definition, summed in float64: x per block of 32 as round(x / d) with
    d = max|x| / 127, times the 4-bit weights, scaled; the biases' share from the quantized x's
    sums (so the whole is W times the quantized x)."""
    xs = np.asarray(x, dtype=np.float32)
    rows, cols = xs.shape
    blocks = xs.reshape(rows, cols // 32, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(blocks * inv).astype(np.float64)
    d = (amax / np.float32(127)).astype(np.float32).astype(np.float64)
    packed = np.asarray(q).view(np.uint8)
    wq = np.stack([packed & 15, packed >> 4], axis=-1).reshape(q.shape[0], cols).astype(np.float64)
    scale = np.repeat(np.asarray(s.astype(mx.float32), dtype=np.float64), group // 32, axis=1)  # per block of 32
    per_block = np.einsum("mbi,nbi->mnb", xq, wq.reshape(-1, cols // 32, 32)) * d[:, None, :, 0]
    products = (per_block * scale[None]).sum(axis=-1)
    xsum = (xq.sum(axis=-1) * d[..., 0]).reshape(rows, cols // group, group // 32).sum(axis=-1)
    out: np.ndarray = products + xsum @ np.asarray(b.astype(mx.float32), dtype=np.float64).T
    return out


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_the_simd_kernel_computes_the_portable_kernels_bits_in_any_batch(
    ext: ModuleType, group: int, dtype: mx.Dtype
) -> None:
    """203 columns (every tile width ends in a partial one), rows 1 to 17 (every count in a block
    of four, and blocks after it); and each row alone gets the bits it gets in the batch: a
    greedy resume on this path equals the uninterrupted run."""
    q, s, b = _quantized(203, 384, group, 4, dtype)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 17):
        x = mx.random.normal((rows, 384), key=mx.random.key(rows))
        want = ext.quantized_matvec(x, q, s, b, group, 4, False, False)  # the portable definition
        for split in (True, False):
            assert mx.array_equal(ext.quantized_matvec(x, q, s, b, group, 4, split, True), want).item(), (rows, split)
        for r in range(rows):
            assert mx.array_equal(ext.quantized_matvec(x[r : r + 1], q, s, b, group, 4)[0], want[r]).item(), r


@pytest.mark.parametrize("group", [32, 128])
def test_the_products_are_the_documented_arithmetic(ext: ModuleType, group: int) -> None:
    q, s, b = _quantized(96, 512, group, 4, mx.float16)
    x = mx.random.normal((5, 512), key=mx.random.key(3)) * mx.linspace(0.1, 4, 512)
    got = np.asarray(ext.quantized_matvec(x, q, s, b, group, 4), dtype=np.float64)
    want = _reference(x, q, s, b, group)
    # float32 sums against float64 ones: the arithmetic, not its rounding, has to agree.
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # And it is not the exact path: 8-bit activations move the results, a little.
    ext.set_numerics("exact")
    exact = np.asarray(ext.quantized_matvec(x, q, s, b, group, 4), dtype=np.float64)
    moved = np.abs(got - exact).max() / np.abs(exact).max()
    assert 0 < moved < 0.02


def test_stacked_siblings_give_each_products_bits(ext: ModuleType) -> None:
    parts = [_quantized(rows, 256, 32, 4, mx.bfloat16) for rows in (130, 66, 66)]
    w, s, b = (mx.concatenate([p[i] for p in parts]) for i in range(3))
    for rows in (1, 3, 8):
        x = mx.random.normal((rows, 1, 256), key=mx.random.key(rows))
        outs = ext.quantized_matvecs(x, w, s, b, 32, 4, [130, 66, 66])
        for got, (q, sc, bi) in zip(outs, parts, strict=True):
            assert mx.array_equal(got, ext.quantized_matvec(x, q, sc, bi, 32, 4)).item()


def test_other_widths_keep_the_exact_products(ext: ModuleType) -> None:
    """Only 4-bit weights have a fast path: 8- and 2-bit products stay MLX's bits."""
    for bits in (8, 2):
        q, s, b = _quantized(64, 256, 64, bits, mx.float16)
        x = mx.random.normal((3, 256), key=mx.random.key(bits))
        fast = ext.quantized_matvec(x, q, s, b, 64, bits)
        ext.set_numerics("exact")
        assert mx.array_equal(fast, ext.quantized_matvec(x, q, s, b, 64, bits)).item()
        ext.set_numerics("fast")


def test_a_row_with_nan_or_inf_says_nan_and_leaves_the_others(ext: ModuleType) -> None:
    q, s, b = _quantized(64, 256, 32, 4, mx.float16)
    x = mx.random.normal((3, 256), key=mx.random.key(5))
    bad = x.at[1, 7].add(float("nan")).at[2, 9].add(float("inf"))
    got = ext.quantized_matvec(bad, q, s, b, 32, 4)
    assert mx.isnan(got[1:]).all().item()
    assert mx.array_equal(got[0], ext.quantized_matvec(x[:1], q, s, b, 32, 4)[0]).item()


def test_the_setting_is_checked_and_auto_is_fast_only_for_large_models(ext: ModuleType) -> None:
    with pytest.raises(ValueError, match="exact or fast"):
        ext.set_numerics("fastest")
    assert ext.numerics() == "fast"
    assert resolve_numerics("auto", 98 << 20) == "exact"  # the bundled model's weights
    assert resolve_numerics("auto", AUTO_FAST_BYTES) == "fast"
    for size in (0, AUTO_FAST_BYTES):
        assert resolve_numerics("exact", size) == "exact" and resolve_numerics("fast", size) == "fast"
    # The fast path's integer dots take the widest the CPU has (-march=native builds them).
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    if ext.simd() != "avx2":
        expected = "portable"
    elif {"avx512_vnni", "avx512vl"} <= flags:
        expected = "avx512-vnni"
    elif "avx_vnni" in flags:
        expected = "avx-vnni"
    else:
        expected = "avx2"
    assert ext.q8_simd() == expected
