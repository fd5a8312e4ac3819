"""mlx-lm's per-step normalization of the logits through lmspd's logsumexp kernel.

``GenerationBatch._step`` and ``generate_step`` normalize every step's logits as
``logits - mx.logsumexp(logits, axis=-1, keepdims=True)``, reaching MLX through
``mlx_lm.generate``'s module global ``mx``. MLX's CPU logsumexp runs its exp one element at a
time on one core (~16 ns an element there: 1.33 ms a step at batch 1 and 9.57 at batch 8 over a
49,152-token vocabulary; docs/benchmarks.md, "The passes", the second). ``install``
gives that module an ``mx`` whose ``logsumexp`` takes exactly those calls to the kernel
(``kernels/elementwise.h``: the same bits, rows on both cores, the exponentials eight at a time)
and hands every other call, and every other name, to ``mlx.core`` itself.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import mlx.core as mx

# By path: ``mlx_lm.generate`` as an attribute is the package's generate() function.
generate: Any = importlib.import_module("mlx_lm.generate")


class KernelMx:
    """``mlx.core`` as ``mlx_lm.generate`` sees it, but for float32 logsumexp over the last axis."""

    def __init__(self, ext: ModuleType) -> None:
        self._ext = ext

    def __getattr__(self, name: str) -> Any:
        value = getattr(mx, name)
        setattr(self, name, value)  # found once: later lookups do not come here
        return value

    def logsumexp(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and kwargs == {"axis": -1, "keepdims": True}:
            (a,) = args
            if isinstance(a, mx.array) and a.dtype == mx.float32 and a.ndim >= 1 and a.shape[-1] > 0:
                return self._ext.logsumexp(a)
        return mx.logsumexp(*args, **kwargs)


def install(ext: ModuleType) -> None:
    """mlx-lm's sampling normalizes through the kernel (idempotent)."""
    if not isinstance(generate.mx, KernelMx):
        generate.mx = KernelMx(ext)
