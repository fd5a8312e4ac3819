"""lmspd's quantized CPU kernels (service/engine/kernels): built here, checked against MLX."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import pytest

from lmspd.engine import kernels, packed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernels are built on Linux only")


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    return kernels.load()


def _quantized(rows: int, cols: int, group: int, bits: int, dtype: mx.Dtype) -> tuple[mx.array, ...]:
    """Packed weights with scales and biases in ``dtype``, as a checkpoint stores them."""
    w = (mx.random.normal((rows, cols), key=mx.random.key(rows + cols + bits)) * 0.2).astype(dtype)
    return tuple(mx.quantize(w, group, bits))


def _exact(q: mx.array, s: mx.array, b: mx.array, group: int, bits: int) -> mx.array:
    """The affine weights scale * q + bias in float32 (MLX's dequantize of float32 scales)."""
    return mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group, bits)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_dequantize_gives_the_affine_weights_bit_for_bit(
    ext: ModuleType, bits: int, group: int, dtype: mx.Dtype
) -> None:
    q, s, b = _quantized(96, 384, group, bits, dtype)
    got = ext.dequantize(q, s, b, group, bits)
    assert got.dtype == mx.float32 and mx.array_equal(got, _exact(q, s, b, group, bits)).item()
    if dtype == mx.float32:  # MLX's own arithmetic is float32 too: the same bits
        assert mx.array_equal(got, mx.dequantize(q, s, b, group, bits)).item()
    else:  # MLX rounds the product and the sum to 16 bits: at most a 16-bit unit apart
        rounded = mx.dequantize(q, s, b, group, bits).astype(mx.float32)
        unit = 2.0 ** -(10 if dtype == mx.float16 else 7) * mx.abs(rounded).max()
        assert (mx.abs(got - rounded).max() > 0).item() and (mx.abs(got - rounded).max() <= unit).item()


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (4, 64), (2, 128)])
@pytest.mark.parametrize("split", [True, False])
def test_matvec_is_the_float32_product_of_the_dequantized_weights(
    ext: ModuleType, rows: int, bits: int, group: int, split: bool
) -> None:
    q, s, b = _quantized(200, 256, group, bits, mx.bfloat16)
    x = mx.random.normal((rows, 256), key=mx.random.key(rows))
    want = x @ _exact(q, s, b, group, bits).T
    got = ext.quantized_matvec(x, q, s, b, group, bits, split)
    assert got.shape == (rows, 200) and got.dtype == mx.float32
    # Only the order of the float32 sums differs from BLAS's.
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_simd_matvec_computes_the_portable_kernels_bits(
    ext: ModuleType, bits: int, group: int, dtype: mx.Dtype
) -> None:
    """The SIMD kernel only lays the work out differently: every sum in the same order, bit for bit
    (203 columns: the one-row path's 4-column tiles and the several-row path's 2-column blocks
    each end in a partial one; every count of rows in a block of eight, and blocks after it)."""
    q, s, b = _quantized(203, 384, group, bits, dtype)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17):
        x = mx.random.normal((rows, 384), key=mx.random.key(rows + bits))
        want = ext.quantized_matvec(x, q, s, b, group, bits, False, False)
        for split in (True, False):
            got = ext.quantized_matvec(x, q, s, b, group, bits, split, True)
            assert mx.array_equal(got, want).item(), (rows, split)


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_a_product_of_many_chunks_computes_every_column_once(ext: ModuleType, rows: int) -> None:
    """The two threads take runs of chunks from the two ends of the columns until they meet
    (pool.h, Pool::claim): hundreds of chunks here, the last one narrower, and every column
    gets the one-thread kernel's bits."""
    q, s, b = _quantized(4099, 256, 32, 4, mx.float16)
    x = mx.random.normal((rows, 256), key=mx.random.key(7 + rows))
    alone = ext.quantized_matvec(x, q, s, b, 32, 4, False)
    for _ in range(20):  # where the threads meet moves from run to run
        assert mx.array_equal(ext.quantized_matvec(x, q, s, b, 32, 4, True), alone).item()


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 64), (2, 32)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_stacked_siblings_give_each_products_bits(ext: ModuleType, bits: int, group: int, dtype: mx.Dtype) -> None:
    """q, k and v (or gate and up) in one call: each output is its own product, bit for bit."""
    parts = [_quantized(rows, 256, group, bits, dtype) for rows in (130, 66, 66)]
    w, s, b = (mx.concatenate([p[i] for p in parts]) for i in range(3))
    for rows in (1, 3, 8):
        x = mx.random.normal((rows, 1, 256), key=mx.random.key(rows))
        outs = ext.quantized_matvecs(x, w, s, b, group, bits, [130, 66, 66])
        alone = ext.quantized_matvecs(x, w, s, b, group, bits, [130, 66, 66], split=False)  # one thread
        for got, one, (q, sc, bi) in zip(outs, alone, parts, strict=True):
            want = ext.quantized_matvec(x, q, sc, bi, group, bits)
            assert got.shape == want.shape and mx.array_equal(got, want).item()
            assert mx.array_equal(one, want).item()
    with pytest.raises(ValueError, match="add up"):
        ext.quantized_matvecs(mx.ones((1, 256)), w, s, b, group, bits, [130, 66])


def test_the_build_says_which_simd_it_runs() -> None:
    import platform

    ext = kernels.load()
    flags = Path("/proc/cpuinfo").read_text()
    x86 = "avx2" if all(f" {f} " in flags for f in ("avx2", "fma", "f16c")) else "portable"  # simd.h's condition
    expected = {"aarch64": "neon", "x86_64": x86}
    assert ext.simd() == expected.get(platform.machine(), "portable")


@pytest.mark.parametrize(("dims", "width"), [(64, 64), (32, 64)])
@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize(("base", "scale"), [(100000.0, 1.0), (10000.0, 0.25)])
def test_table_rope_is_mx_fast_rope_bit_for_bit(
    ext: ModuleType, dims: int, width: int, traditional: bool, base: float, scale: float
) -> None:
    cos, sin = packed.rope_tables(dims, base, scale, 4096)
    for batch, heads, rows in ((1, 9, 1), (8, 3, 1), (2, 4, 5)):
        x = mx.random.normal((batch, heads, rows, width), key=mx.random.key(batch + rows))
        for offset in (0, 1, 99, 4000):
            want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
            got = ext.rope(x, cos, sin, mx.array(offset, dtype=mx.int32), dims, traditional)
            assert mx.array_equal(got, want).item(), (batch, rows, offset)
        offsets = mx.array([3 * b + 5 for b in range(batch)], dtype=mx.int32)  # a batch's, one per row
        want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offsets)
        assert mx.array_equal(ext.rope(x, cos, sin, offsets, dims, traditional), want).item()


@pytest.mark.parametrize("shape", [(1, 1, 576), (8, 1, 576), (1, 512, 576), (3, 7, 64)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_is_mx_fast_rms_norm_bit_for_bit(ext: ModuleType, shape: tuple[int, ...], eps: float) -> None:
    for scale in (1.0, 1e-3, 100.0):
        x = mx.random.normal(shape, key=mx.random.key(shape[1])) * scale
        w = mx.random.normal((shape[-1],), key=mx.random.key(shape[-1]))
        assert mx.array_equal(ext.rms_norm(x, w, eps), mx.fast.rms_norm(x, w, eps)).item(), scale


def test_table_rope_past_its_tables_is_nan_never_a_wrong_angle(ext: ModuleType) -> None:
    cos, sin = packed.rope_tables(16, 10000.0, 1.0, 8)
    x = mx.ones((2, 1, 1, 16))
    got = ext.rope(x, cos, sin, mx.array([7, 8], dtype=mx.int32), 16, True)
    assert not mx.isnan(got[0]).any().item() and mx.isnan(got[1]).all().item()


def test_matvec_keeps_leading_dimensions(ext: ModuleType) -> None:
    q, s, b = _quantized(64, 128, 32, 4, mx.float16)
    x = mx.random.normal((2, 3, 128), key=mx.random.key(7))
    got = ext.quantized_matvec(x, q, s, b, 32, 4)
    assert got.shape == (2, 3, 64)
    assert mx.allclose(got, x @ _exact(q, s, b, 32, 4).T, rtol=1e-5, atol=1e-5).item()


def test_inputs_it_cannot_take_are_refused(ext: ModuleType) -> None:
    q, s, b = _quantized(64, 128, 32, 4, mx.bfloat16)
    x = mx.ones((1, 128))
    with pytest.raises(ValueError, match="bits/group_size"):
        ext.quantized_matvec(x, q, s, b, 32, 3)
    with pytest.raises(ValueError, match="float32"):
        ext.quantized_matvec(x.astype(mx.bfloat16), q, s, b, 32, 4)
    with pytest.raises(ValueError, match="the same"):
        ext.quantized_matvec(x, q, s, b.astype(mx.float32), 32, 4)
    with pytest.raises(ValueError, match="input size"):
        ext.quantized_matvec(mx.ones((1, 96)), q, s, b, 32, 4)
    with pytest.raises(ValueError, match="do not match"):
        ext.dequantize(q, s[:, :2], b[:, :2], 32, 4)


def test_a_build_is_cached_under_a_key_of_its_inputs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    built = kernels.built()
    assert built is not None and built == kernels.build()  # the fixture's build, found again
    changed = tmp_path / "quantized.cpp"
    changed.write_text(kernels.SOURCE.read_text() + "\n// changed\n")
    key = kernels.build_key()
    monkeypatch.setattr(kernels, "SOURCE", changed)
    assert kernels.build_key() != key  # edited source: a new build, not the stale binary
    header = tmp_path / "simd.h"
    header.write_text(kernels.HEADERS[0].read_text() + "\n// changed\n")
    key = kernels.build_key()
    monkeypatch.setattr(kernels, "HEADERS", (header, *kernels.HEADERS[1:]))
    assert kernels.build_key() != key  # an edited header too


def test_a_machine_without_a_compiler_is_told_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(kernels.KernelUnavailable, match="no C\\+\\+ compiler"):
        kernels.build(tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-built left behind


def test_a_failed_compile_says_what_the_compiler_said(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "quantized.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    with pytest.raises(kernels.KernelUnavailable, match="did not compile"):
        kernels.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*/*.so"))
    assert shutil.which("c++") is not None


def test_a_build_leaves_no_temporary_directory_neither_its_own_nor_a_killed_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "quantized.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    stale = tmp_path / "cache" / kernels.build_key() / f"{kernels.BUILD_PREFIX}killed"
    stale.mkdir(parents=True)
    (stale / "half.o").write_bytes(b"half")
    with pytest.raises(kernels.KernelUnavailable, match="did not compile"):
        kernels.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob(f"*/{kernels.BUILD_PREFIX}*"))  # at start and on error


def test_activations_in_any_layout_are_read_as_their_values(ext: ModuleType) -> None:
    """Activations reach the primitives without a Contiguous node (arrays.h, rows_of): a
    transposed, sliced or broadcast x gives the bits its contiguous copy gives."""
    q, s, b = _quantized(96, 128, 32, 4, mx.float16)
    base = mx.random.normal((128, 6), key=mx.random.key(11))
    layouts = {
        "transposed": base.T,  # (6, 128), column-major
        "sliced": mx.random.normal((6, 256), key=mx.random.key(12))[:, ::2],
        "broadcast": mx.broadcast_to(base[:, 0], (6, 128)),
    }
    cos, sin = packed.rope_tables(128, 10000.0, 1.0, 64)
    at = mx.array(5, dtype=mx.int32)
    norm_w = mx.random.normal((128,), key=mx.random.key(13))
    for name, x in layouts.items():
        dense = mx.array(x.tolist())  # the same values, row-contiguous
        pairs = [
            (ext.quantized_matvec(x, q, s, b, 32, 4), ext.quantized_matvec(dense, q, s, b, 32, 4)),
            (
                ext.quantized_matvecs(x, q, s, b, 32, 4, [32, 64])[1],
                ext.quantized_matvecs(dense, q, s, b, 32, 4, [32, 64])[1],
            ),
            (ext.rms_norm(x, norm_w, 1e-5), ext.rms_norm(dense, norm_w, 1e-5)),
            (
                ext.rope(x.reshape(1, 6, 1, 128), cos, sin, at, 128, False),
                ext.rope(dense.reshape(1, 6, 1, 128), cos, sin, at, 128, False),
            ),
            (
                ext.rope(x[None, :, None], cos, sin, at, 128, True),
                ext.rope(dense[None, :, None], cos, sin, at, 128, True),
            ),
        ]
        for i, (got, want) in enumerate(pairs):
            assert got.shape == want.shape and mx.array_equal(got, want).item(), (name, i)


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "keys", "dim"),
    [(1, 9, 3, 101, 64), (8, 9, 3, 37, 64), (2, 4, 4, 1, 32), (3, 8, 2, 700, 128)],
)
def test_attention_at_decode_is_mx_fast_attention_bit_for_bit(
    ext: ModuleType, batch: int, heads: int, kv_heads: int, keys: int, dim: int
) -> None:
    """One query row per sequence, against MLX's own CPU fallback: no mask, a boolean one (a
    batch's left padding), an additive one; keys as a KV cache's slice of a longer buffer, and
    stored transposed (the fallback's other BLAS call)."""
    q = mx.random.normal((batch, heads, 1, dim), key=mx.random.key(1))
    k = mx.random.normal((batch, kv_heads, keys + 50, dim), key=mx.random.key(2))[..., :keys, :]
    v = mx.random.normal((batch, kv_heads, keys + 50, dim), key=mx.random.key(3))[..., :keys, :]
    masks = [
        None,
        mx.random.uniform(shape=(batch, 1, 1, keys), key=mx.random.key(4)) > 0.3,
        mx.random.normal((batch, heads, 1, keys), key=mx.random.key(5)),
        mx.random.normal((keys,), key=mx.random.key(6)),
    ]
    column_major = mx.swapaxes(mx.swapaxes(k, 2, 3) + 0, 2, 3)
    for kk, vv in ((k, v), (column_major, column_major)):
        for mask in masks:
            want = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=dim**-0.5, mask=mask)
            got = ext.attention(q, kk, vv, mask, dim**-0.5)
            assert got.shape == want.shape and mx.array_equal(got, want).item(), None if mask is None else mask.shape


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "rows", "keys", "dim"),
    [(1, 9, 3, 37, 37, 64), (1, 9, 3, 64, 600, 64), (2, 4, 4, 5, 9, 32), (3, 8, 2, 17, 130, 128)],
)
def test_attention_over_a_prompt_is_mx_fast_attention_bit_for_bit(
    ext: ModuleType, batch: int, heads: int, kv_heads: int, rows: int, keys: int, dim: int
) -> None:
    """A prompt's many query rows (a whole prompt, or a chunk after cached keys), against MLX's
    own CPU fallback: the causal mask, none, a boolean one (a batch's left padding), additive
    ones; keys as a KV cache's slice of a longer buffer, and stored transposed."""
    q = mx.random.normal((batch, heads, rows, dim), key=mx.random.key(11))
    k = mx.random.normal((batch, kv_heads, keys + 50, dim), key=mx.random.key(12))[..., :keys, :]
    v = mx.random.normal((batch, kv_heads, keys + 50, dim), key=mx.random.key(13))[..., :keys, :]
    causal = mx.arange(keys - rows, keys)[:, None] >= mx.arange(keys)[None]
    padded = causal & (mx.arange(keys)[None] >= mx.arange(batch)[:, None, None, None])  # (B, 1, L, keys)
    masks: list[mx.array | str | None] = [
        "causal",
        None,
        padded,
        mx.random.normal((batch, heads, rows, keys), key=mx.random.key(15)),
        mx.random.normal((keys,), key=mx.random.key(16)),
    ]
    transposed_q = mx.swapaxes(mx.swapaxes(q, 1, 2) + 0, 1, 2)  # (B, L, H, D) in memory, as a layer makes it
    column_major = mx.swapaxes(mx.swapaxes(k, 2, 3) + 0, 2, 3)
    for qq, kk, vv in ((q, k, v), (transposed_q, column_major, column_major)):
        for mask in masks:
            want = mx.fast.scaled_dot_product_attention(qq, kk, vv, scale=dim**-0.5, mask=mask)
            m = None if isinstance(mask, str) else mask
            got = ext.attention(qq, kk, vv, m, dim**-0.5, mask == "causal")
            label = mask if mask is None or isinstance(mask, str) else mask.shape
            assert got.shape == want.shape and mx.array_equal(got, want).item(), label


ON_THE_ENGINES_BLAS = """
from lmspd.engine.upstream import blas
print(blas.load("auto"))
import mlx.core as mx
from lmspd.engine import kernels
ext = kernels.load()
for b, h, kv, rows, keys in ((1, 9, 3, 512, 2000), (2, 9, 3, 100, 300)):
    q = mx.random.normal((b, rows, h, 64), key=mx.random.key(1)).transpose(0, 2, 1, 3)
    k = mx.random.normal((b, kv, keys + 256, 64), key=mx.random.key(2))[..., :keys, :]
    v = mx.random.normal((b, kv, keys + 256, 64), key=mx.random.key(3))[..., :keys, :]
    pad = (mx.arange(keys)[None] >= 7 * mx.arange(b)[:, None, None, None]) & (
        mx.arange(keys - rows, keys)[:, None] >= mx.arange(keys)[None])
    for mask in ("causal", pad):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        got = ext.attention(q, k, v, None if isinstance(mask, str) else mask, 0.125, isinstance(mask, str))
        assert mx.array_equal(got, want).item(), (b, rows, keys, mask if isinstance(mask, str) else mask.shape)
print("same bits")
"""


def test_attention_over_a_prompt_on_the_engines_blas(ext: ModuleType) -> None:
    """The engine runs on the system's OpenBLAS (engine/upstream/blas.py), threaded, whose
    sgemm a prompt's scores and outputs go through: in a process that loads it as the engine
    does, a 512-row chunk over 2,000 keys and a left-padded batch are the fallback's bits."""
    from lmspd.engine.upstream import blas

    if blas.find("auto") is None:
        pytest.skip("no system OpenBLAS here (apt install libopenblas0-pthread); the bundled BLAS is tested above")
    done = subprocess.run(
        [sys.executable, "-c", ON_THE_ENGINES_BLAS], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("same bits"), done.stdout + done.stderr
    assert "openblas" in done.stdout


def test_attention_wrapper_takes_mlx_lms_calls(ext: ModuleType) -> None:
    """packed.Attention, as mlx-lm's layers call it: a prompt's "causal" string and a decode
    row go to the kernel (the fallback's bits); what it cannot take goes to mlx-lm's own."""
    from mlx_lm.models import base

    calls: list[str] = []

    def original(*args: object, **kwargs: object) -> mx.array:
        calls.append("mlx-lm")
        out: mx.array = base.scaled_dot_product_attention(*args, **kwargs)
        return out

    attention = packed.Attention(original, ext)
    q = mx.random.normal((1, 4, 6, 16), key=mx.random.key(21))
    k = mx.random.normal((1, 2, 6, 16), key=mx.random.key(22))
    for queries, mask in ((q, "causal"), (q[:, :, -1:], None), (q[:, :, -1:], "causal")):
        got = attention(queries, k, k, None, 0.25, mask)
        want = mx.fast.scaled_dot_product_attention(queries, k, k, scale=0.25, mask=mask)
        assert mx.array_equal(got, want).item()
    assert calls == []
    attention(q.astype(mx.float16), k.astype(mx.float16), k.astype(mx.float16), None, 0.25, "causal")
    assert calls == ["mlx-lm"]


def test_attention_refuses_what_it_cannot_take(ext: ModuleType) -> None:
    q, k = mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 5, 8))
    with pytest.raises(ValueError, match="query rows"):
        ext.attention(mx.zeros((1, 4, 0, 8)), k, k, None, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        ext.attention(mx.zeros((1, 3, 1, 8)), k, k, None, 1.0)
    with pytest.raises(ValueError, match="broadcast"):
        ext.attention(q, k, k, mx.zeros((1, 4, 1, 6)), 1.0)
    with pytest.raises(ValueError, match="bool or float32"):
        ext.attention(q, k, k, mx.zeros((5,), dtype=mx.int32), 1.0)
    with pytest.raises(ValueError, match="causal"):
        ext.attention(mx.zeros((1, 4, 6, 8)), k, k, None, 1.0, True)


def test_swiglu_is_mlx_lms_bit_for_bit(ext: ModuleType) -> None:
    """mlx-lm's compiled swiglu against the kernel, on both its paths (eight lanes at once and
    the scalar tail): wide ranges, and the values the exp polynomial treats apart (signed zeros,
    subnormals, beyond +-88, infinities, NaN), each at every lane position."""
    from mlx_lm.models.activations import swiglu

    for seed in range(8):
        scale = mx.random.normal((8, 1, 1539), key=mx.random.key(30 + seed)) * (1 + 40 * (seed % 4))
        gate = mx.random.normal((8, 1, 1539), key=mx.random.key(seed)) * scale
        x = mx.random.normal((8, 1, 1539), key=mx.random.key(10 + seed))
        assert mx.array_equal(ext.swiglu(gate, x), swiglu(gate, x)).item(), seed
    special = [0.0, -0.0, 1e-40, -1e-40, 88.0, -88.0, 88.1, -88.1, 1e4, -1e4, float("inf"), -float("inf"), float("nan")]
    for shift in range(9):
        gate = mx.array([1.5] * shift + special * 2)
        x = mx.linspace(-2, 2, gate.size)
        assert mx.array_equal(ext.swiglu(gate, x), swiglu(gate, x), equal_nan=True).item(), shift
    with pytest.raises(ValueError, match="one shape"):
        ext.swiglu(mx.zeros((2, 3)), mx.zeros((3,)))


def test_logsumexp_is_mx_logsumexp_bit_for_bit(ext: ModuleType) -> None:
    """Over a vocabulary's width at several scales, and rows with infinities and NaN."""
    for seed in range(4):
        x = mx.random.normal((8, 49152 + seed), key=mx.random.key(seed)) * (1 + 30 * seed)
        assert mx.array_equal(ext.logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True)).item(), seed
    inf, nan = float("inf"), float("nan")
    rows = mx.array([[0.0, inf, 1.0], [-inf, -inf, -inf], [nan, 1.0, 2.0], [1.0, 2.0, nan], [-1e30, 5.0, 88.0]])
    assert mx.array_equal(ext.logsumexp(rows), mx.logsumexp(rows, axis=-1, keepdims=True), equal_nan=True).item()
    with pytest.raises(ValueError, match="float32"):
        ext.logsumexp(mx.zeros((2, 0)))
