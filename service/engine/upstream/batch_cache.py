"""A batch's KV cache merged with room for its next position.

mlx-lm's ``BatchKVCache.merge`` (how a request's prompt cache, or several, become a batch's)
allocates exactly the positions the caches hold. The batch's next step then finds no room:
``update_and_fetch`` grows the cache by concatenating 256 empty positions, a copy of every
position held (46 KB a token for SmolLM2-135M: 92 MB for 2,000 cached tokens), and that step
cannot take lmspd's decode block (upstream/decode_block.py needs room for the position), so it
runs mlx-lm's slower code. Every request whose prompt came whole from the prompt cache paid both
on its first token.

``merge`` here is upstream's with one change: the buffers it allocates (zeros, as upstream's)
are rounded up to the next multiple of the cache's step past the positions held, as
``update_and_fetch`` would grow them. The positions held, the offsets and the padding are
upstream's; the attention reads only the positions held, through the same strides, so the same
bits (tests/engine/test_batch_cache.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as caches

_upstream_merge = caches.BatchKVCache.__dict__["merge"]  # the classmethod itself


def merge(cls: Any, batch: list[Any]) -> Any:
    """``BatchKVCache.merge`` (mlx-lm 0.32's, line for line) with room past the positions held."""
    lengths = [c.size() for c in batch]
    max_length = max(lengths)
    if max_length == 0:
        return cls([0] * len(batch))
    padding = [max_length - n for n in lengths]
    held = [c for c in batch if c.keys is not None]
    heads = max(c.keys.shape[1] for c in held)
    dk = max(c.keys.shape[3] for c in held)
    dv = max(c.values.shape[3] for c in batch if c.values is not None)
    dtype = held[0].keys.dtype
    room = (max_length // cls.step + 1) * cls.step
    keys = mx.zeros((len(batch), heads, room, dk), dtype=dtype)
    values = mx.zeros((len(batch), heads, room, dv), dtype=dtype)
    for i, (p, c) in enumerate(zip(padding, batch, strict=True)):
        if c.keys is None:
            continue
        keys[i : i + 1, :, p : p + c.offset] = c.keys[..., : c.offset, :]
        values[i : i + 1, :, p : p + c.offset] = c.values[..., : c.offset, :]
    merged = cls(padding)
    merged.keys = keys
    merged.values = values
    merged.offset += max_length
    merged._idx = max_length
    return merged


def install() -> None:
    """mlx-lm's batches merge their caches with room (``KVCache.merge`` calls this too)."""
    caches.BatchKVCache.merge = classmethod(merge)


def uninstall() -> None:
    """Upstream's merge back (the tests and bench compare the two)."""
    caches.BatchKVCache.merge = _upstream_merge
