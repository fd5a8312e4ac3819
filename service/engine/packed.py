"""``quantized_float32``: quantized weights that stay packed, computed in float32.

Each quantized layer of the model is replaced by one that keeps MLX's packed weights and
float32 copies of their scales and biases (exact: they are 16-bit floats or float32 already),
and multiplies through lmspd's kernels (``kernels/quantized.cpp``):

- a decode step's few rows go through ``quantized_matvec``, which unpacks each weight group
  once for all rows;
- a prefill's many rows go through ``dequantize`` into a transient float32 matrix and BLAS,
  as fast as dense float32 weights.

Every product uses the dequantized weights exactly, in float32 arithmetic, as the float32
choice does, while the model keeps its quantized size (SmolLM2-135M: 540 MB of float32
weights against 100 MB packed).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUPS = (32, 64, 128)
# Up to this many rows the matvec kernel beats dequantize + BLAS (measured on 576x1536:
# 0.55 against 0.63 ms at 8 rows, 0.75 against 0.60 at 16); an output as wide as a
# vocabulary makes the transient matrix costly, so the kernel keeps more rows there.
KERNEL_ROWS = 8
KERNEL_ROWS_WIDE = 32
WIDE = 8192


class PackedLinear(nn.Module):  # type: ignore[misc]  # mlx is untyped
    def __init__(self, source: Any, ext: ModuleType) -> None:
        super().__init__()
        self.weight = source.weight
        self.scales = source.scales.astype(mx.float32)
        self.biases = source.biases.astype(mx.float32)
        if "bias" in source:
            self.bias = source.bias
        self.group_size: int = source.group_size
        self.bits: int = source.bits
        self._ext = ext
        out = self.weight.shape[0]
        self._kernel_rows = KERNEL_ROWS_WIDE if out >= WIDE else KERNEL_ROWS

    def _product(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] <= self._kernel_rows:
            out: mx.array = self._ext.quantized_matvec(
                x, self.weight, self.scales, self.biases, self.group_size, self.bits
            )
            return out
        dense: mx.array = self._ext.dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)
        return x @ dense.T

    def __call__(self, x: mx.array) -> mx.array:
        y = self._product(x)
        return y + self.bias if "bias" in self else y


class PackedEmbedding(PackedLinear):
    """A quantized embedding: rows looked up packed; ``as_linear`` (tied output head) is the
    same product as a linear layer's."""

    def __call__(self, x: mx.array) -> mx.array:
        return mx.dequantize(self.weight[x], self.scales[x], self.biases[x], self.group_size, self.bits)

    def as_linear(self, x: mx.array) -> mx.array:
        return self._product(x)


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


def pack(model: nn.Module, ext: ModuleType) -> None:
    """Replace the model's quantized layers in place and run everything else in float32."""
    swapped = [
        (path, PackedEmbedding(m, ext) if isinstance(m, nn.QuantizedEmbedding) else PackedLinear(m, ext))
        for path, m in _quantized(model)
    ]
    model.update_modules(tree_unflatten(swapped))
    model.set_dtype(mx.float32)  # norms and any dense layer: what the float32 choice computes in
