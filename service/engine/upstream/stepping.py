"""Decode steps that hand each token out as soon as its forward pass is done (CPU backend).

mlx-lm's ``GenerationBatch._step`` pipelines: it builds and ``mx.async_eval``s the pass for
token n + 1 and only then returns token n, so that on Metal the GPU computes the next pass
while Python handles this token. On MLX's CPU backend ``async_eval`` returns only once most of
the work it was given is done (a 2.2 s chain of ops: its ``async_eval`` call took 1.9 s), so
nothing overlaps and every token is handed out one pass late: a first token costs two passes
(a cached prompt's first token took 2.6 decode steps, docs/benchmarks.md, "Step profile"), a
new request's first pass runs apart from the batch's, and each request ends with a pass
whose token nobody reads.

``StepNow`` changes only that order: a step runs the pass for the tokens handed out last
time, waits for it, and hands out its tokens. A batch made for new requests runs no pass of
its own: its first tokens come from the next step, with the running requests' rows. Every
row sees the same inputs, cache and logits processors as before, so greedy outputs are the
same token for token (``tests/engine/test_stepping.py``).

It relies on ``GenerationBatch``'s private state (``_step``, ``_next_tokens``,
``_next_logprobs``, ``__init__`` calling ``_step`` once): upstream/README.md.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx

# By path: ``mlx_lm.generate`` as an attribute is the package's generate() function.
generate: Any = importlib.import_module("mlx_lm.generate")

_Upstream: Any = generate.GenerationBatch


class StepNow(_Upstream):  # type: ignore[misc]
    """``GenerationBatch`` whose step returns the tokens its own pass computed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._deferred = True  # __init__'s own _step: no pass yet (the next step runs it)
        super().__init__(*args, **kwargs)
        self._deferred = False
        # Rows not yet stepped: placeholders, so filter() and extend() index as upstream does.
        self._next_logprobs = [None] * len(self.uids)

    def _step(self) -> tuple[list[int], list[Any]]:
        if self._deferred:
            return [], []
        super()._step()  # the pass over the tokens handed out last time, started
        tokens, logprobs = self._next_tokens, self._next_logprobs
        mx.eval(tokens, logprobs)  # ...and finished: its tokens are this step's
        return list(tokens.tolist()), list(logprobs)


def install() -> bool:
    """On the CPU backend, mlx-lm's batches step with ``StepNow`` (True when installed)."""
    if mx.metal.is_available():
        return False
    generate.GenerationBatch = StepNow
    return True
