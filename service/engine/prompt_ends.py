"""The next-token logprobs at the end of recent prompts, so that an exact repeat of a cached
prompt takes its first token without a forward pass.

A cached prompt still needs the logits after its last token. Without them the prompt cache
hands out every token's KV but the last, and the request's first step runs that token again:
one decode pass before the first token, for logits an earlier request already computed
(what that cost: docs/benchmarks.md, "Seventh pass"). The pass is a
function of the tokens alone, so its logprobs, kept here beside the KV, are the ones it would
give again: each row of a decode step is computed as it would be alone, whatever the batch
beside it (tests/engine/test_engine.py, ``test_a_seeded_request_is_unaffected_by_its_batch``).

Only a pass without logits processors is kept (a grammar's mask is the request's own), and
only a request without them uses one. Kept per namespace, as the KV is (a shared prompt end
would answer faster: the same side channel, docs/responses.md, "The prompt cache"), in
memory only, least recently used first out, within ``max_bytes`` (``PromptCache.fit`` gives
them a sixteenth of the prompt cache's bound, 16 MiB at most).

Only the engine process imports this module (it imports MLX).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import mlx.core as mx

# 16 MiB holds ~85 prompt ends of a 49k-token vocabulary, ~27 of a 152k one.
DEFAULT_MAX_BYTES = 16 << 20

Key = tuple[Hashable, tuple[int, ...]]


class PromptEnds:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._kept: OrderedDict[Key, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, namespace: Hashable, tokens: Sequence[int], logprobs: Any) -> None:
        """Keep the logprobs (one row) a pass over ``tokens``' last token gave. A copy: the
        row is a view of its step's whole batch, which it would otherwise hold."""
        row = mx.array(logprobs)
        mx.eval(row)
        key = (namespace, tuple(tokens))
        old = self._kept.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        if row.nbytes > self.max_bytes:
            return
        self._kept[key] = row
        self.nbytes += row.nbytes
        self._trim()

    def resize(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._trim()

    def _trim(self) -> None:
        while self.nbytes > self.max_bytes:
            _, evicted = self._kept.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def get(self, namespace: Hashable, tokens: Sequence[int]) -> Any | None:
        """The logprobs after exactly ``tokens`` in ``namespace``, or None."""
        key = (namespace, tuple(tokens))
        row = self._kept.get(key)
        if row is not None:
            self._kept.move_to_end(key)
        return row

    def clear(self) -> None:
        self._kept.clear()
        self.nbytes = 0
