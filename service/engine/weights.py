"""Weight dtype: keep a model quantized or run it dense, by setting, rule or measurement.

On Metal quantized matmuls are fast; on the CPU backend MLX's own may not be (the
mlx-cpu wheel's 4-bit kernel is single-threaded) and dense weights can win.

``auto`` only weighs choices that keep the quantized model's weights: float32
holds every weight mx.dequantize gives exactly, and ``quantized_float32`` keeps
them packed and computes each as its exact affine value scale * q + bias in
float32 (packed.py, lmspd's kernels; offered where the kernels build).

Where lmspd's kernels run the model (the CPU backend, Linux), auto takes
``quantized_float32`` without timing anything: it computes what float32 computes
from a fifth of its memory, and its decode reads a sixth of the bytes. Timing
used to decide there too, and on a busy machine one start in three measured
float32 within the 10% margin and took it (half the decode speed, 1 GB more):
a rule gives the same answer every start. Elsewhere auto times the model's own
layer shapes in each candidate dtype and keeps the fastest, excluding dense
dtypes whose weights would take more than a fixed share of memory; among
choices within 10% of the fastest it keeps a packed one for its memory.

bfloat16 weights are not exact (8-bit mantissa), and on SmolLM2-135M they turned
"The capital of France is Paris." into "L'Étoile, la Marseillaise," -- so half
precision is only ever used when a user asks for it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from lmspd.engine import kernels, packed
from lmspd.engine.upstream import decode_block

log = logging.getLogger("lmspd.engine.weights")

AUTO_CANDIDATES = ("float32",)  # dense dtypes that reproduce the quantized model exactly
PACKED = ("quantized", "quantized_float32")  # choices that keep the weights' quantized size
_MEMORY_SHARE = 0.4  # dense weights may take at most this share of memory
_PACKED_MARGIN = 1.1  # a packed choice this close to the fastest is kept for its memory


def _quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def _memory_bytes() -> int:
    if mx.metal.is_available():
        return int(mx.device_info().get("max_recommended_working_set_size", 0)) or _system_memory()
    return _system_memory()


def _system_memory() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _param_count(model: nn.Module) -> int:
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            total += m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits
    return total


def _sample_layers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """The quantized matmuls of one transformer block, each weighted by the number of
    blocks, plus the output projection (the tied embedding when there is no lm_head)."""
    layers = _quantized_modules(model)
    blocks = len({n.split(".layers.")[1].split(".")[0] for n, _ in layers if ".layers." in n})
    block = [(m, blocks) for n, m in layers if ".layers.0." in n and isinstance(m, nn.QuantizedLinear)]
    heads = [m for n, m in layers if n.endswith("lm_head")] or [m for n, m in layers if n.endswith("embed_tokens")]
    sample = block + [(m, 1) for m in heads[:1]]
    return sample or [(m, 1) for _, m in layers[:8]]


def _time(fn: Any, reps: int) -> float:
    mx.eval(fn())  # warm-up: kernels compile / caches fill
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - start) / reps


def _activation_dtype(model: nn.Module) -> mx.Dtype:
    """What a quantized model computes in: its widest float parameter dtype (norms, scales)."""
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    for dt in (mx.float32, mx.bfloat16, mx.float16):
        if dt in dtypes:
            return dt
    return mx.float32


def _runner(m: nn.Module, dtype: str, act: mx.Dtype) -> tuple[Any, mx.Dtype]:
    if dtype == "quantized_float32":
        return packed.PackedLinear(m, kernels.load()), mx.float32
    if dtype == "quantized":
        return (lambda x: mx.quantized_matmul(x, m.weight, m.scales, m.biases, True, m.group_size, m.bits)), act
    xdt = getattr(mx, dtype)
    w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(xdt)
    mx.eval(w)
    return (lambda x: x @ w.T), xdt


def _seconds(modules: list[tuple[nn.Module, int]], dtype: str, act: mx.Dtype, rows: int, reps: int) -> float:
    total = 0.0
    for m, weight in modules:
        run, xdt = _runner(m, dtype, act)
        x = mx.random.normal((rows, m.weight.shape[1] * 32 // m.bits)).astype(xdt)
        total += weight * _time(lambda run=run, x=x: run(x), reps)
    return total


def measure(model: nn.Module, kernel_dir: str = "", prefill_rows: int = 8) -> dict[str, float]:
    """Seconds per token of the sampled layers for each candidate dtype (lower is faster).

    The score weighs prompt and output tokens equally. Candidates more than 1.5x
    slower than the best at decoding are dropped before the costlier prefill timing.
    """
    modules = _sample_layers(model)
    act = _activation_dtype(model)
    budget = _memory_bytes() * _MEMORY_SHARE
    candidates = ["quantized"] + [d for d in AUTO_CANDIDATES if _param_count(model) * getattr(mx, d).size <= budget]
    if _packed_reason(model, kernel_dir) is None:
        candidates.append("quantized_float32")
    decode = {d: _seconds(modules, d, act, 1, 3) for d in candidates}
    best = min(decode.values())
    return {
        d: t + _seconds(modules, d, act, prefill_rows, 1) / prefill_rows for d, t in decode.items() if t <= 1.5 * best
    }


def _packed_reason(model: nn.Module, kernel_dir: str) -> str | None:
    """Why ``quantized_float32`` cannot run this model here (None: it can)."""
    reason = packed.unsupported(model)
    if reason is None:
        try:
            kernels.load(kernels.cache_root(kernel_dir))
        except kernels.KernelUnavailable as exc:
            reason = str(exc)
    if reason is not None:
        log.warning("weight dtype quantized_float32 unavailable: %s", reason)
    return reason


def choose(scores: dict[str, float]) -> str:
    """The fastest choice, unless a packed one is within the margin of it."""
    best = min(scores, key=scores.__getitem__)
    near = [d for d in PACKED if d in scores and scores[d] <= scores[best] * _PACKED_MARGIN]
    return min(near, key=scores.__getitem__) if near else best


def fixed_choice(model: nn.Module, kernel_dir: str) -> str | None:
    """auto's choice where a rule decides (None: measure): the packed kernels where they run."""
    if mx.metal.is_available():
        return None
    return "quantized_float32" if _packed_reason(model, kernel_dir) is None else None


def apply_weight_dtype(model: nn.Module, setting: str, kernel_dir: str = "") -> str:
    """Convert the model in place per ``setting``; returns the dtype it now runs in
    (``kernel_dir``: where lmspd's kernels are built, "" for the default)."""
    if not _quantized_modules(model):
        return "dense"
    choice = setting
    if setting == "auto" and (fixed := fixed_choice(model, kernel_dir)) is not None:
        choice = fixed
        log.info("weight dtype auto: %s (lmspd's kernels run this model: float32 results, packed weights)", choice)
    elif setting == "auto":
        scores = measure(model, kernel_dir)
        choice = choose(scores)
        log.info("weight dtype auto: %s (scores %s)", choice, {k: f"{v * 1e3:.2f}ms" for k, v in scores.items()})
    if choice == "quantized":
        return choice
    if choice == "quantized_float32":
        if (reason := packed.unsupported(model)) is not None:
            raise kernels.KernelUnavailable(reason)
        ext = kernels.load(kernels.cache_root(kernel_dir))
        packed.pack(model, ext)
        decode_block.install(model, ext)
        mx.eval(model.parameters())
        mx.clear_cache()
        return choice
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    model.set_dtype(getattr(mx, choice))
    # One weight at a time: each quantized original is freed as its dense copy is made, so
    # the load never holds both models (the peak stays near the dense model's size).
    for _, weight in tree_flatten(model.parameters()):
        mx.eval(weight)
    mx.clear_cache()
    return choice


# ``auto`` takes the fast path for a model whose weight files hold at least this many bytes:
# where it pays (docs/numerics.md, "What auto runs": 1.14x on a 715 MB model, 1.02x on the
# bundled 94 MB one, whose greedy answers it would change for 2%).
AUTO_FAST_BYTES = 256 << 20


def resolve_numerics(setting: str, weight_bytes: int) -> str:
    """``[engine] numerics`` as a model of ``weight_bytes`` (its weight files) runs it: ``auto``
    is fast from AUTO_FAST_BYTES on, exact below; ``fast`` without its SIMD kernel is
    honoured (the portable kernel computes the same bits)."""
    if setting == "auto":
        return "fast" if weight_bytes >= AUTO_FAST_BYTES else "exact"
    return setting


def weight_file_bytes(model_dir: Path) -> int:
    """The bytes of a model's weight files: the same on every host of a group, so every rank
    resolves ``auto`` alike."""
    return sum(f.stat().st_size for f in model_dir.glob("model*.safetensors"))  # as mlx-lm loads them


def apply_numerics(model: nn.Module, dtype: str, setting: str, kernel_dir: str = "", weight_bytes: int = 0) -> str:
    """What a model now run in ``dtype`` computes its products with (docs/numerics.md): "fast"
    only where lmspd's kernels multiply 4-bit weights; the kernels set to it (the setting is the
    process's: stepper.Stepper sets it again before each of the model's steps)."""
    if dtype != "quantized_float32":
        return "exact"  # MLX's own products
    chosen = resolve_numerics(setting, weight_bytes)
    four_bit = any(getattr(m, "bits", 0) == 4 for _, m in model.named_modules() if isinstance(m, packed.PackedLinear))
    numerics = chosen if four_bit else "exact"
    kernels.load(kernels.cache_root(kernel_dir)).set_numerics(numerics)
    return numerics
