"""``quantized_float32``: quantized weights that stay packed, computed in float32.

Each quantized layer of the model is replaced by one that keeps MLX's packed weights, scales
and biases as they are, and multiplies through lmspd's kernels (``kernels/quantized.h``):

- a decode step's few rows go through ``quantized_matvec``, which unpacks each weight group
  once for all rows;
- a prefill's many rows go through ``dequantize`` into a transient float32 matrix and BLAS,
  as fast as dense float32 weights;
- attention, a decode step's and a prompt's, goes through ``attention``, one primitive where
  mx.fast.scaled_dot_product_attention on the CPU builds a dozen, with the very BLAS calls
  and softmax of that fallback, its exponentials eight at a time on both cores
  (``kernels/attention.h``);
- mlx-lm's ``swiglu``, and the logsumexp its sampling normalizes each step's logits by, go
  through ``swiglu`` and ``logsumexp``: MLX's exp on eight elements at a time on both cores
  where MLX runs it one at a time on one (``kernels/elementwise.h``);
- a decode step's rotary embeddings go through ``rope``, one primitive where mx.fast.rope on
  the CPU is its ~15-primitive fallback, from tables of the fallback's own cos and sin; every
  RMSNorm through ``rms_norm``, one primitive for mx.fast.rms_norm's eight.

Every product uses exactly the weights mx.dequantize gives (rounded to the scales' dtype as
MLX's arithmetic rounds them), in float32 arithmetic: the float32 choice's weights, bit for
bit, while the model keeps its quantized size (SmolLM2-135M: 540 MB of float32 weights
against ~90 MB packed).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUPS = (32, 64, 128)
# Up to this many rows the matvec kernel beats dequantize + BLAS: a prefill dequantizes every
# matrix of the model once per chunk, which the kernel never does. SmolLM2-135M, a prompt of
# n new rows after 100 cached tokens, the whole forward pass, alternating (docs/benchmarks.md,
# "Fifth pass"): 24 rows 116.9 against 148.5 ms, 32 rows 155.8 against 177.5, 40 rows 262.3
# against 280.7, 48 rows 271.3 against 264.9. An output as wide as a vocabulary makes the
# transient matrix costly, so the kernel keeps more rows there.
KERNEL_ROWS = 32
KERNEL_ROWS_WIDE = 40
WIDE = 8192


class PackedLinear(nn.Module):  # type: ignore[misc]  # mlx is untyped
    def __init__(self, source: Any, ext: ModuleType) -> None:
        super().__init__()
        self.weight = source.weight
        self.scales = source.scales
        self.biases = source.biases
        if "bias" in source:
            self.bias = source.bias
        self.group_size: int = source.group_size
        self.bits: int = source.bits
        self._ext = ext
        out = self.weight.shape[0]
        self._kernel_rows = KERNEL_ROWS_WIDE if out >= WIDE else KERNEL_ROWS
        self._siblings: Siblings | None = None  # set by pack: this layer's products ride with its siblings'
        self._index = 0

    def _product(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] <= self._kernel_rows:
            if self._siblings is not None:
                return self._siblings.output(self._index, x)
            out: mx.array = self._ext.quantized_matvec(
                x, self.weight, self.scales, self.biases, self.group_size, self.bits
            )
            return out
        dense: mx.array = self._ext.dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)
        return x @ dense.T

    def __call__(self, x: mx.array) -> mx.array:
        y = self._product(x)
        return y + self.bias if "bias" in self else y


# Layers of one block that multiply the same x, by the attribute names mlx-lm's models use.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Siblings:
    """Sibling layers' products of one x (a block's q, k and v; gate and up) as one kernel call
    at decode (``quantized_matvecs``): one dispatch instead of three, and columns enough for both
    cores (a 192-wide k or v product alone is mostly fixed cost). Their weights are stacked once,
    each layer keeping a view of its rows (no copy kept). The first sibling called with an x
    computes every output; the others take theirs while x is the same array."""

    def __init__(self, layers: list[PackedLinear], ext: ModuleType) -> None:
        self.weight = mx.concatenate([m.weight for m in layers])
        self.scales = mx.concatenate([m.scales for m in layers])
        self.biases = mx.concatenate([m.biases for m in layers])
        mx.eval(self.weight, self.scales, self.biases)
        self.widths = [int(m.weight.shape[0]) for m in layers]
        self.group_size, self.bits = layers[0].group_size, layers[0].bits
        self._ext = ext
        start = 0
        for i, (m, width) in enumerate(zip(layers, self.widths, strict=True)):
            rows = slice(start, start + width)
            m.weight, m.scales, m.biases = self.weight[rows], self.scales[rows], self.biases[rows]
            mx.eval(m.weight, m.scales, m.biases)
            m._siblings, m._index = self, i
            start += width
        self._x: mx.array | None = None
        self._outputs: list[mx.array] = []

    def output(self, index: int, x: mx.array) -> mx.array:
        if index == 0 or self._x is not x:
            self._x = x
            self._outputs = self._ext.quantized_matvecs(
                x, self.weight, self.scales, self.biases, self.group_size, self.bits, self.widths
            )
        out = self._outputs[index]
        if index == len(self.widths) - 1:
            self._x, self._outputs = None, []  # the last sibling: nothing held past the step
        return out

    @staticmethod
    def find(model: nn.Module) -> list[list[PackedLinear]]:
        """Each module's sibling layers that can share a call: packed alike, without a bias."""
        found: list[list[PackedLinear]] = []
        for _, module in model.named_modules():
            for names in SIBLINGS:
                layers = [module.get(n) for n in names]
                if not all(type(m) is PackedLinear and "bias" not in m for m in layers):
                    continue
                first = layers[0]
                if all(
                    m.weight.shape[1] == first.weight.shape[1]
                    and (m.bits, m.group_size, m.scales.dtype) == (first.bits, first.group_size, first.scales.dtype)
                    for m in layers
                ):
                    found.append(layers)
        return found


class PackedEmbedding(PackedLinear):
    """A quantized embedding: rows looked up packed; ``as_linear`` (tied output head) is the
    same product as a linear layer's."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = mx.dequantize(self.weight[x], self.scales[x], self.biases[x], self.group_size, self.bits)
        return rows.astype(mx.float32)  # the scales' dtype, exactly; the model runs in float32

    def as_linear(self, x: mx.array) -> mx.array:
        return self._product(x)


class TableRoPE(nn.Module):  # type: ignore[misc]  # mlx is untyped
    """nn.RoPE, bit for bit, for one new position per row (a decode step), or a chunk of a few
    (up to ``KERNEL_ROWS``: rows then carry a decode step's bits), in one primitive.

    The tables are what mx.fast.rope's CPU fallback computes for each position (the same MLX
    ops, on all positions at once); a prompt's many positions, and anything else, go to
    mx.fast.rope itself."""

    def __init__(self, rope: nn.RoPE, tables: tuple[mx.array, mx.array], ext: ModuleType) -> None:
        super().__init__()
        self.dims: int = rope.dims
        self.traditional: bool = rope.traditional
        self.base: float = rope.base
        self.scale: float = rope.scale
        self._cos, self._sin = tables  # "_": not parameters
        self._ext = ext

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        rows = x.shape[-2] if x.ndim >= 3 else 0
        if 0 < rows <= KERNEL_ROWS and x.dtype == mx.float32:
            at: mx.array | None = None
            if isinstance(offset, int):
                at = mx.array(offset, dtype=mx.int32) if offset >= 0 and offset + rows <= self._cos.shape[0] else None
            elif offset.dtype == mx.int32 and offset.ndim <= 1:  # a batch's, one per row, each < its context
                at = offset
            if at is not None:
                out: mx.array = self._ext.rope(x, self._cos, self._sin, at, self.dims, self.traditional)
                return out
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)


class FusedRMSNorm(nn.Module):  # type: ignore[misc]  # mlx is untyped
    """nn.RMSNorm, bit for bit, in one primitive where mx.fast.rms_norm on the CPU is eight."""

    def __init__(self, norm: nn.RMSNorm, ext: ModuleType) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps: float = norm.eps
        self._ext = ext

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype == mx.float32 and self.weight.dtype == mx.float32:
            out: mx.array = self._ext.rms_norm(x, self.weight, self.eps)
            return out
        return mx.fast.rms_norm(x, self.weight, self.eps)


class Attention:
    """mlx-lm's ``scaled_dot_product_attention`` for float32 calls without attention sinks on a
    plain KV cache, a decode step's one query row or a prompt's many (causal, or under a batch's
    mask), in one primitive, bit for bit the fallback mx.fast.scaled_dot_product_attention runs
    on the CPU (tests/engine/test_kernels.py); every other call goes to mlx-lm's own."""

    def __init__(self, original: Any, ext: ModuleType) -> None:
        self.original = original
        self._ext = ext

    def __call__(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        causal = mask == "causal" if isinstance(mask, str) else False
        m = None if mask is None or isinstance(mask, str) else mask
        if (
            sinks is None
            and queries.dtype == keys.dtype == values.dtype == mx.float32
            and queries.ndim == keys.ndim == 4
            and (not isinstance(mask, str) or causal)
            and queries.shape[2] <= keys.shape[2]
            and not hasattr(cache, "bits")
            and (m is None or (isinstance(m, mx.array) and m.dtype in (mx.bool_, mx.float32) and m.ndim <= 4))
        ):
            # A chunk of a few rows (a verified draft, a resumed suffix, a short prompt) takes
            # each row as a decode step computes it: the same bits as decoding those tokens.
            each_row = queries.shape[2] <= KERNEL_ROWS
            out: mx.array = self._ext.attention(queries, keys, values, m, scale, causal, each_row)
            return out
        result: mx.array = self.original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return result


class SwiGLU:
    """mlx-lm's ``swiglu(gate, x)`` in one primitive on both cores for float32 arrays of one
    shape (``kernels/elementwise.h``), bit for bit; anything else goes to mlx-lm's own."""

    def __init__(self, original: Any, ext: ModuleType) -> None:
        self.original = original
        self._ext = ext

    def __call__(self, gate: mx.array, x: mx.array) -> mx.array:
        if gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape:
            out: mx.array = self._ext.swiglu(gate, x)
            return out
        result: mx.array = self.original(gate, x)
        return result


def use_module_kernels(model: nn.Module, ext: ModuleType) -> None:
    """Point the model's mlx-lm modules at Attention and SwiGLU (each module binds mlx-lm's
    ``scaled_dot_product_attention`` and ``swiglu`` as globals at import), and mlx-lm's sampling
    at the logsumexp kernel (upstream/logsumexp.py). Process-wide, and harmless to other models
    there: the calls these take get the bits they got."""
    from mlx_lm.models import activations, base

    from lmspd.engine.upstream import logsumexp

    kernels = (
        ("scaled_dot_product_attention", base.scaled_dot_product_attention, Attention),
        ("swiglu", activations.swiglu, SwiGLU),
    )
    for name in {type(module).__module__ for _, module in model.named_modules()}:
        namespace = sys.modules.get(name)
        for attr, original, wrapper in kernels:
            if getattr(namespace, attr, None) is original:
                setattr(namespace, attr, wrapper(original, ext))
    logsumexp.install(ext)  # and mlx-lm's sampling, its logits' logsumexp


def rope_tables(dims: int, base: float, scale: float, positions: int) -> tuple[mx.array, mx.array]:
    """cos and sin of every position's angles, as mx.fast.rope's fallback computes them."""
    half = dims // 2
    pos = (mx.arange(positions, dtype=mx.float32) + mx.array(0, dtype=mx.int32)) * mx.array(scale, dtype=mx.float32)
    inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (mx.log(mx.array(base, dtype=mx.float32)) / half))
    theta = pos[:, None] * inv_freqs
    cos, sin = mx.cos(theta), mx.sin(theta)
    mx.eval(cos, sin)
    return cos, sin


def _leaves(model: nn.Module, kind: type) -> list[tuple[str, Any]]:
    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    return [(path, m) for path, m in leaves if type(m) is kind]  # subclasses compute otherwise


def _quantized(model: nn.Module) -> list[tuple[str, Any]]:
    leaves = tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
    return [(path, m) for path, m in leaves if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def unsupported(model: nn.Module) -> str | None:
    """Why this model's quantization cannot run packed, or None when it can."""
    for path, m in _quantized(model):
        if getattr(m, "mode", "affine") != "affine" or m.get("biases") is None:
            return f"{path} is not affine-quantized"
        if m.bits not in SUPPORTED_BITS or m.group_size not in SUPPORTED_GROUPS:
            return f"{path} has {m.bits}-bit groups of {m.group_size}"
        if m.scales.dtype not in (mx.float16, mx.bfloat16, mx.float32):
            return f"{path} has {m.scales.dtype} scales"
    return None


def packed_matrix_bytes(model: nn.Module) -> int:
    """The largest float32 matrix a prefill dequantizes for this model (0: none)."""
    sizes = [
        m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits * 4
        for _, m in model.named_modules()
        if isinstance(m, PackedLinear) and m._kernel_rows == KERNEL_ROWS
    ]
    return max(sizes, default=0)


def pack(model: nn.Module, ext: ModuleType) -> None:
    """Replace the model's quantized layers in place and run everything else in float32."""
    swapped = [
        (path, PackedEmbedding(m, ext) if isinstance(m, nn.QuantizedEmbedding) else PackedLinear(m, ext))
        for path, m in _quantized(model)
    ]
    kept = [(layer, layer.scales, layer.biases) for _, layer in swapped]
    model.update_modules(tree_unflatten(swapped))
    # Norms and any dense layer compute in float32, as under the float32 choice; the scales
    # and biases stay as stored (the kernels read them in their own dtype).
    model.set_dtype(mx.float32)
    for layer, scales, biases in kept:
        layer.scales, layer.biases = scales, biases
    # Every position the model can take: the engine refuses a prompt past its context.
    positions = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        tables: dict[tuple[int, float, float], tuple[mx.array, mx.array]] = {}
        ropes = []
        for path, rope in _leaves(model, nn.RoPE):
            key = (rope.dims, float(rope.base), float(rope.scale))
            if key not in tables:
                tables[key] = rope_tables(*key, positions)
            ropes.append((path, TableRoPE(rope, tables[key], ext)))
        model.update_modules(tree_unflatten(ropes))
    norms = [(path, FusedRMSNorm(norm, ext)) for path, norm in _leaves(model, nn.RMSNorm)]
    model.update_modules(tree_unflatten(norms))
    for layers in Siblings.find(model):
        Siblings(layers, ext)
    use_module_kernels(model, ext)
    # A pass of up to this many rows computes each with a decode step's bits when every product
    # is a kernel's (a dense layer's BLAS product is not row for row): a verified draft and a
    # resumed suffix rely on it (upstream/stepping.py, docs/numerics.md). 0: no such promise.
    model._decode_rows = 0 if _leaves(model, nn.Linear) else KERNEL_ROWS
