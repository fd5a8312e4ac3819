"""How much memory a model will take once loaded, estimated before loading it.

Read from its files alone (the safetensors headers and config.json; no MLX, so the server can
refuse an oversized model at intake and the engine can make room before it loads): its weights
as the engine will hold them per ``weight_dtype``, plus its KV cache for ``max_concurrency``
streams of a typical length. The engine's own count of a loaded model's bytes replaces the
estimate once it is loaded.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import msgspec

from lmspd.config import EngineConfig
from lmspd.errors import ModelTooLargeError

# The default memory budget: this share of physical memory (on a 16 GB machine, 9.6 GB: the
# OS and the programs lmspd shares the machine with keep the rest).
DEFAULT_MEMORY_SHARE = 0.6
# The KV a model is budgeted for: each of max_concurrency streams this many tokens long (or
# the model's context, if shorter). Longer conversations take more; the budget has slack.
TYPICAL_TOKENS = 2048
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1}
_DENSE = {"float32": 4, "float16": 2, "bfloat16": 2}


class Footprint(msgspec.Struct, frozen=True, kw_only=True):
    weights: int  # bytes, as held per weight_dtype
    kv: int  # bytes of KV for the budgeted streams

    @property
    def total(self) -> int:
        return self.weights + self.kv


def memory_budget(max_memory_bytes: int | None, physical: int | None = None) -> int:
    """The budget in force: the configured one, else DEFAULT_MEMORY_SHARE of physical memory
    (this host's, or ``physical`` bytes)."""
    if max_memory_bytes is not None:
        return max_memory_bytes
    if physical is None:
        try:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError):
            return 1 << 62  # unknown: no bound beyond max_loaded_models
    return int(physical * DEFAULT_MEMORY_SHARE)


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _group_size(quantization: dict[str, Any], prefix: str) -> int:
    own = quantization.get(prefix)
    return int(own["group_size"]) if isinstance(own, dict) else int(quantization.get("group_size", 64))


@functools.lru_cache(maxsize=64)
def weight_bytes(path: Path, weight_dtype: str) -> int:
    """The weights' bytes once loaded: packed as stored for the quantized choices and for
    ``auto`` (its smallest choice: it measures before it picks a dense one), dequantized to the
    dtype's width for float32, float16 and bfloat16."""
    config = json.loads((path / "config.json").read_text())
    quantization = config.get("quantization") or {}
    width = _DENSE.get(weight_dtype)
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        header = _header(file)
        for name, info in header.items():
            stored = math.prod(info["shape"]) * _BYTES.get(info["dtype"], 4)
            prefix, _, leaf = name.rpartition(".")
            quantized = f"{prefix}.scales" in header
            if width is None:
                total += stored
            elif not quantized:
                total += math.prod(info["shape"]) * width
            elif leaf == "weight":  # packed: as many values as its scales cover
                total += math.prod(header[f"{prefix}.scales"]["shape"]) * _group_size(quantization, prefix) * width
            # a quantized matrix's scales and biases are gone once it is dense
    return total


def kv_bytes(config: dict[str, Any], streams: int, weight_dtype: str, tokens: int = TYPICAL_TOKENS) -> int:
    layers = int(config.get("num_hidden_layers") or 0)
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or 0) // heads)
    context = int(config.get("max_position_embeddings") or tokens)
    width = 2 if weight_dtype in ("float16", "bfloat16") else 4
    return 2 * layers * kv_heads * head_dim * width * streams * min(tokens, context)


def estimate(path: Path, weight_dtype: str, streams: int) -> Footprint:
    config = json.loads((path / "config.json").read_text())
    return Footprint(weights=weight_bytes(path, weight_dtype), kv=kv_bytes(config, streams, weight_dtype))


def estimate_or_zero(path: Path, engine: EngineConfig) -> Footprint:
    """The estimate, or nothing where the files cannot be read (the load then says why)."""
    try:
        return estimate(path, engine.weight_dtype, engine.max_concurrency)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return Footprint(weights=0, kv=0)


def refuse_oversized(name: str, path: Path, engine: EngineConfig) -> Footprint:
    """ModelTooLargeError (naming the model, its estimate and the budget) for a model that
    cannot fit in the memory budget even alone; else its estimate. An engine split over a group
    of hosts with no budget configured has the hosts' budgets summed, which only its engine
    knows (engine/group: it refuses there, at load)."""
    found = estimate_or_zero(path, engine)
    budget = memory_budget(engine.max_memory_bytes)
    if engine.hosts and engine.max_memory_bytes is None:
        return found
    if found.total > budget:
        raise ModelTooLargeError(
            f"model '{name}' needs about {found.total} bytes ({found.weights} of weights as "
            f"{engine.weight_dtype}, {found.kv} of KV for {engine.max_concurrency} streams of "
            f"{TYPICAL_TOKENS} tokens), more than the memory budget of {budget} bytes "
            "([engine] max_memory_bytes)",
            param="model",
        )
    return found
