"""Decode steps that hand each token out as soon as its forward pass is done (CPU backend), and
run one pass ahead only while nothing about the batch is about to change.

mlx-lm's ``GenerationBatch._step`` pipelines: it builds and ``mx.async_eval``s the pass for
token n + 1 and only then returns token n, so that on Metal the GPU computes the next pass
while Python handles this token. On MLX's CPU backend ``async_eval`` returns only once most of
the work it was given is done (MLX's CPU scheduler takes ten tasks of ten primitives before it
blocks), so every token is handed out most of a pass late: a first token costs two passes (a
cached prompt's first token took 53.2 ms, 29.7 with this: docs/benchmarks.md, "The passes", the
first), a new request's first pass runs apart from the batch's, and each request ends with a
pass whose token nobody reads.

``StepNow`` runs a step *now*: the pass for the tokens handed out last time, waited for, its
tokens handed out. A batch made for new requests runs no pass of its own: its first tokens come
from the next step, with the running requests' rows. Every row sees the same inputs, cache and
logits processors as before, so greedy outputs are the same token for token
(``tests/engine/test_stepping.py``).

Once a batch has settled (a step after the last request joined, no request joining, no logits
processors, no request at its last token), it runs *ahead*, as upstream does: a step starts
the pass after the one in flight and hands out the in-flight one's tokens. With a step of 168
primitives, about 100 of them still run when ``async_eval`` returns, and the Python around a
step (the engine loop's handling of the tokens, the next graph's construction: ~2 ms at batch
1) runs meanwhile instead of before the pass (docs/benchmarks.md, "Seventh pass"). The tokens
are the same either way; only when they are evaluated moves. A step that runs ahead never
meets a joining request: ``BatchGenerator._next`` says before its generation step whether a
prompt is waiting (``steady``), and a batch ahead finishes the pass in flight and hands it out
(``_drain``) before anything joins.

A batch of one greedy request without logits processors *speculates* (a ``drafter`` per
request, engine/speculation.py's, handed to ``install``): its next input and a prompt-lookup
draft go through one pass of a few rows, whose rows carry a decode step's bits
(kernels/attention.h, ``attend_each_row``); the drafted tokens the model itself picks are kept
and handed out one a step without a pass, the rest trimmed off the cache. While its drafter
looks for drafts the batch does not run ahead (a draft needs the token in flight); while the
drafter waits (after a lookup that found nothing, or drafts the model did not keep) it does.
The tokens are the ones decoding gives, bit for bit (``tests/engine/test_speculation.py``); a
request joining while kept tokens wait gets the batch back as it would be had they been
decoded one at a time.

It relies on ``GenerationBatch``'s private state (``_step``, ``_next_tokens``,
``_next_logprobs``, ``_num_tokens``, ``__init__`` calling ``_step`` once) and on
``BatchGenerator._next``, ``_unprocessed_sequences``, ``_prompt_batch`` and
``_generation_batch``: upstream/README.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

# By path: ``mlx_lm.generate`` as an attribute is the package's generate() function.
generate: Any = importlib.import_module("mlx_lm.generate")

_Upstream: Any = generate.GenerationBatch
_upstream_next: Any = generate.BatchGenerator._next


class StepNow(_Upstream):  # type: ignore[misc]
    """``GenerationBatch`` whose step returns the tokens its own pass computed, or, once the
    batch has settled, the tokens of the pass in flight; a lone greedy request's, from a
    verified draft when it has one."""

    # The longest draft, and how a request's drafter is made (install's; 0, None: no drafts).
    max_draft: int = 0
    drafter: Callable[[int], Any] | None = None
    # Whether a settled batch may run a pass ahead (not in a group of hosts: the pass's sends
    # would be in flight when the loop's next tick goes over the same ring, engine/group).
    run_ahead: bool = True
    # Upstream's state (untyped there): the tokens the next pass feeds, and their logprobs.
    _next_tokens: Any
    _next_logprobs: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._deferred = True  # __init__'s own _step: no pass yet (the next step runs it)
        self._ahead = False  # a pass over the tokens handed out last is in flight, unread
        self._settled = False  # a step has run since the last request joined
        self.steady = False  # no prompt waits to join (BatchGenerator._next says, each step)
        # Speculation, for a batch of one: the tokens a verified draft kept, each with its
        # logprobs, not yet handed out; the last one handed out; each uid's drafter.
        self._kept: list[tuple[int, Any]] = []
        self._handed: tuple[int, Any] | None = None
        self._drafters: dict[int, Any] = {}
        self.drafted = 0  # tokens drafted and tokens kept, over the batch's life (the bench's)
        self.accepted = 0
        super().__init__(*args, **kwargs)
        self._deferred = False
        # Rows not yet stepped: placeholders, so filter() and extend() index as upstream does.
        self._next_logprobs = [None] * len(self.uids)

    def _step(self) -> tuple[list[int], list[Any]]:
        if self._deferred:
            return [], []
        if self._kept:  # a verified draft's next token: no pass
            self._handed = self._kept.pop(0)
            return [self._handed[0]], [self._handed[1]]
        if self._ahead and self._speculates():
            self._drafter().wait()  # a step of its pause, gone by ahead
        if not self._ahead and (draft := self._draft()):
            return self._verify(draft)
        if self._ahead:
            if not self._may_run_ahead():
                return self._drain()
            # The pass after the one in flight, started; the in-flight one's tokens, handed out.
            tokens, logprobs = super()._step()
            return list(tokens), list(logprobs)
        super()._step()  # the pass over the tokens handed out last time, started
        tokens, logprobs = self._next_tokens, self._next_logprobs
        mx.eval(tokens, logprobs)  # ...and finished: its tokens are this step's
        handed = list(tokens.tolist()), list(logprobs)
        if self._settled and self._may_run_ahead():
            super()._step()  # the next pass, over these tokens, started before they go out
            self._ahead = True
        self._settled = True
        return handed

    def _may_run_ahead(self) -> bool:
        """Whether the pass after the next tokens may start before they are handed out: no
        prompt is waiting to join, no row's logits processors need the tokens' values, and no
        row's next token is its last by ``max_tokens`` (a pass after it would be wasted)."""
        return (
            self.run_ahead
            and self.steady
            and not any(self.logits_processors)
            and all(n + 1 < m for n, m in zip(self._num_tokens, self.max_tokens, strict=True))
            and not (self._speculates() and not self._drafter().waiting())
        )

    def _speculates(self) -> bool:
        """Whether the batch drafts: one greedy request, no logits processors, nothing joining."""
        return (
            self.drafter is not None
            and 0 < self.max_draft < getattr(self.model, "_decode_rows", 0)
            and len(self.uids) == 1
            and self.steady
            and not any(self.logits_processors)
            and (self.samplers[0] if self.samplers else self.fallback_sampler) is greedy_sampler
        )

    def _draft(self) -> list[int]:
        """The lone request's draft behind its next input (``_next_tokens``), [] for none."""
        if not self._speculates() or self._next_tokens is None:
            return []
        # Never past the request's last token.
        room = self.max_tokens[0] - self._num_tokens[0] - 1
        draft: list[int] = self._drafter().propose(self.tokens[0], self._next_tokens.tolist(), room)
        return draft

    def _drafter(self) -> Any:
        """The lone request's drafter (made on first use)."""
        assert self.drafter is not None  # _speculates
        drafter = self._drafters.get(self.uids[0])
        if drafter is None:
            drafter = self._drafters[self.uids[0]] = self.drafter(self.max_draft)
        return drafter

    def _verify(self, draft: list[int]) -> tuple[list[int], list[Any]]:
        """The next input and ``draft`` in one pass; the drafted tokens the model picks kept
        (the first handed out now), the others trimmed off the cache."""
        x = self._next_tokens
        inputs = mx.concatenate([x, mx.array(draft, dtype=x.dtype)])[None]
        logits = self.model(inputs, cache=self.prompt_cache)[0]
        # As _step normalizes and samples each row: the same logsumexp, greedy's argmax.
        logprobs = logits - generate.mx.logsumexp(logits, axis=-1, keepdims=True)
        picks = greedy_sampler(logprobs)
        mx.eval(picks, logprobs)
        picked: list[int] = picks.tolist()
        accepted = 0
        while accepted < len(draft) and picked[accepted] == draft[accepted]:
            accepted += 1
        if accepted < len(draft):
            for c in self.prompt_cache:
                c.trim(len(draft) - accepted)
        self.tokens[0].extend([*x.tolist(), *draft[:accepted]])
        self._drafters[self.uids[0]].kept(len(draft), accepted)
        self.drafted += len(draft)
        self.accepted += accepted
        rows = [(picked[i], logprobs[i]) for i in range(accepted + 1)]
        self._handed, self._kept = rows[0], rows[1:]
        self._next_tokens = mx.array([picked[accepted]], dtype=x.dtype)
        self._next_logprobs = [rows[-1][1]]
        self._settled = True
        return [rows[0][0]], [rows[0][1]]

    def _unkeep(self) -> None:
        """Kept tokens not yet handed out taken back: the cache and the next input as though
        the tokens handed out had been decoded one at a time."""
        if not self._kept or self._handed is None:
            return
        back = len(self._kept)
        for c in self.prompt_cache:
            c.trim(back)
        del self.tokens[0][-back:]
        self._next_tokens = mx.array([self._handed[0]], dtype=self._next_tokens.dtype)
        self._next_logprobs = [self._handed[1]]
        self._kept = []

    def _drain(self) -> tuple[list[int], list[Any]]:
        """The pass in flight, finished and handed out; nothing started after it."""
        tokens, logprobs = self._next_tokens, self._next_logprobs
        mx.eval(tokens, logprobs)
        self._ahead = False
        return list(tokens.tolist()), list(logprobs)

    def extend(self, batch: Any) -> None:
        if self._ahead:  # its rows' next tokens are unread outputs, the new rows' are inputs
            raise RuntimeError("a request joined a batch running a pass ahead")
        self._unkeep()
        super().extend(batch)
        self._settled = False

    def filter(self, keep: list[int]) -> None:
        if 0 not in keep:  # the lone row speculating left: its kept tokens with it
            self._kept = []
        super().filter(keep)
        for uid in set(self._drafters) - set(self.uids):
            del self._drafters[uid]
        if not keep:
            self._ahead = False


def _next(self: Any) -> Any:
    """``BatchGenerator._next``, telling its generation batch first whether a prompt waits."""
    batch = self._generation_batch
    if isinstance(batch, StepNow):
        batch.steady = not self._unprocessed_sequences and len(self._prompt_batch) == 0
    return _upstream_next(self)


def install(max_draft: int = 0, drafter: Callable[[int], Any] | None = None, run_ahead: bool = True) -> bool:
    """On the CPU backend, mlx-lm's batches step with ``StepNow`` (True when installed), a lone
    greedy request verifying drafts of up to ``max_draft`` tokens from a ``drafter(max_draft)``
    of its own (engine/speculation.py's Drafter; 0 or None: none), running passes ahead where
    ``run_ahead``."""
    if mx.metal.is_available():
        return False
    StepNow.max_draft, StepNow.drafter, StepNow.run_ahead = max_draft, drafter, run_ahead
    generate.GenerationBatch = StepNow
    generate.BatchGenerator._next = _next
    return True
