"""A model split by layers over the group's ranks (pipeline parallelism, as mlx-lm's
``PipelineMixin`` splits Qwen2 and DeepSeek; its Llama has none, so this is that split for
Llama's family, the bundled model's).

The last rank holds the first layers and rank 0 the last ones: the hidden state goes down
the ranks (each ``send``\\s its layers' output to the rank before it, a ring neighbour), and
rank 0's final state is gathered to every rank, each of which then computes the same norm,
head and sampling (docs/distributed.md, "A step"). Every rank keeps the embeddings (the head,
for a tied model) and the final norm; its layers are only its own, so the layers of the
others are never read from the file. Each layer computes exactly what it computes in one
process, so greedy output is the same token for token.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from lmspd.engine import protocol as p
from lmspd.engine.group.ring import Group
from lmspd.errors import EngineGroupError


class PipelinedLlama(llama.LlamaModel):  # type: ignore[misc]  # mlx-lm is untyped
    """``LlamaModel`` holding the layers [start, end) of the whole model's."""

    pipeline_rank: int
    pipeline_size: int
    start: int
    end: int
    layers: list[Any]

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None) -> mx.array:
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        rank, size = self.pipeline_rank, self.pipeline_size
        if rank < size - 1:  # the layers before this rank's, from the rank after it
            h = mx.distributed.recv_like(h, rank + 1)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask, cache=c)
        if rank != 0:
            h = mx.distributed.send(h, rank - 1)
            # A prefill step evaluates only the caches: the send goes with them, or rank 0
            # waits for it (as mlx-lm's Qwen2 pipeline does).
            if cache[-1] is not None:
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        # Rank 0's state (the last layers') on every rank, in the graph of each one's logits.
        h = mx.distributed.all_gather(h)[: h.shape[0]]
        out: mx.array = self.norm(h)
        return out

    def hold(self, rank: int, counts: list[int]) -> None:
        """Keep rank ``rank``'s layers of the ``counts`` each rank holds, the last rank first."""
        self.pipeline_rank = rank
        self.pipeline_size = len(counts)
        self.start = sum(counts[rank + 1 :])
        self.end = self.start + counts[rank]
        self.layers = self.layers[self.start : self.end]


def layer_counts(total: int, memory: list[int], fixed: list[int]) -> list[int]:
    """Layers per rank: ``fixed`` when configured, else in proportion to each rank's memory
    (largest remainders; every rank at least one)."""
    if fixed:
        if sum(fixed) != total:
            raise EngineGroupError(f"engine.host_layers sums to {sum(fixed)}; the model has {total} layers")
        return list(fixed)
    if total < len(memory):
        raise EngineGroupError(f"the model has {total} layers, fewer than the group's {len(memory)} hosts")
    spare = total - len(memory)
    whole = sum(memory)
    shares = [spare * m / whole for m in memory]
    counts = [1 + int(s) for s in shares]
    by_remainder = sorted(range(len(memory)), key=lambda r: (-(shares[r] - int(shares[r])), r))
    for r in by_remainder[: total - sum(counts)]:
        counts[r] += 1
    return counts


def split(model: Any, rank: int, counts: list[int]) -> tuple[int, int]:
    """Keep rank ``rank``'s layers of a model loaded lazily (before its weights are read);
    the layers [start, end) it now holds."""
    inner: Any = getattr(model, "model", None)
    if type(inner) is not llama.LlamaModel:
        raise EngineGroupError(f"a {type(model).__module__} model cannot be split over hosts yet (Llama's family can)")
    if inner.swa_idx is not None:
        raise EngineGroupError("a model with sliding-window layers cannot be split over hosts yet")
    if sum(counts) != len(inner.layers):
        raise EngineGroupError(f"the split {counts} does not cover the model's {len(inner.layers)} layers")
    inner.__class__ = PipelinedLlama
    inner.hold(rank, counts)
    return inner.start, inner.end


_digests: dict[tuple[str, int, int], str] = {}


def model_digest(model_dir: Path) -> str:
    """SHA-256 of a model's config and weights, by content: what the hosts of a group must
    hold alike (a missing or unreadable file gives a digest no other host has). Files are
    hashed once per size and modification time."""
    h = hashlib.sha256()
    try:
        h.update((model_dir / "config.json").read_bytes())
        for f in sorted(model_dir.glob("*.safetensors")):
            st = f.stat()
            key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
            if key not in _digests:
                fh = hashlib.sha256()
                with f.open("rb") as src:
                    while chunk := src.read(8 << 20):
                        fh.update(chunk)
                _digests[key] = fh.hexdigest()
            h.update(f"{f.name}:{_digests[key]}".encode())
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return h.hexdigest()


def shares(group: Group, model: Any, resident: int) -> list[p.HostShare]:
    """Every host's part of ``model`` (split here), each rank's layers and bytes gathered."""
    inner = model.model
    mine = p.HostShare(
        rank=group.rank,
        host=group.hosts[group.rank],
        layers=[inner.start, inner.end],
        resident_bytes=resident,
        memory_bytes=group.members[group.rank].memory,
        link_bytes_per_sec=group.link_bytes_per_sec,
    )
    return [msgspec.msgpack.decode(b, type=p.HostShare) for b in group.gather(msgspec.msgpack.encode(mine))]
