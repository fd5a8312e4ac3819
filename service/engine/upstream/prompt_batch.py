"""A prompt batch handed over whole when every prompt in it is prefilled.

mlx-lm's ``BatchGenerator`` moves the prompts whose prefill is done to generation with
``PromptProcessingBatch.split(indices)``, which deep-copies the whole batch (its KV cache with
it) and then filters the two copies down (mlx-lm 0.32). The prompts of a batch are prefilled
together, so almost always every one of them is done at once, and then the copy is waste: a copy
of every position the batch holds (46 KB a token for SmolLM2-135M), 2.4–3.2 ms for one
41-token prompt on the benchmark machine, paid before the request's first token
(docs/benchmarks.md, "Eighth pass"). ``split`` here, when the indices are the whole batch, hands
this batch's state to the new one and leaves this one empty, as upstream's ``filter([])`` leaves
it; for part of a batch it is upstream's.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

# By path: ``mlx_lm.generate`` as an attribute is the package's generate() function.
generate: Any = importlib.import_module("mlx_lm.generate")

_upstream_split: Any = generate.PromptProcessingBatch.split

# The per-sequence state upstream's filter() narrows (PromptProcessingBatch.__init__).
_PER_SEQUENCE = ("uids", "prompt_cache", "tokens", "samplers", "logits_processors", "max_tokens", "stop_sequences")


def split(self: Any, indices: list[int]) -> Any:
    """``PromptProcessingBatch.split``: the sequences at ``indices`` as a new batch, the rest
    left in this one."""
    if sorted(indices) != list(range(len(self.uids))):
        return _upstream_split(self, indices)
    moved = copy.copy(self)  # the same lists and caches, nothing copied
    for name in _PER_SEQUENCE:
        setattr(self, name, [])
    return moved


def install() -> None:
    generate.PromptProcessingBatch.split = split


def uninstall() -> None:
    generate.PromptProcessingBatch.split = _upstream_split
