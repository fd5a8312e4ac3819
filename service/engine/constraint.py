"""Constrained decoding in the engine: a llguidance matcher per request, as a logits mask.

A grammar is compiled once per (model, grammar), in a thread of its own while the batch
decodes (the worker), and kept in a bounded LRU; each request decodes with a copy of the
compiled matcher, within a per-step budget (:data:`STEP_MAX_ITEMS`). The mask is a logits processor
of mlx-lm's BatchGenerator, so constrained and free requests share one batch.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

GRAMMAR_CACHE_SIZE = 64
# The Earley items llguidance may build for one request's mask in one decode step (its
# default is 50,000, which measured up to 60 ms for one mask here; 20,000 stays under ~15 ms).
# A grammar that needs more ends its request with an error instead of slowing every other
# request in the batch. Intake validates with the same limits (lmspd.responses.enforce).
STEP_MAX_ITEMS = 20_000


def parser_limits() -> Any:
    """llguidance's ``LLParserLimits`` for every grammar lmspd compiles: at intake and here."""
    from llguidance import LLParserLimits

    return LLParserLimits(step_max_items=STEP_MAX_ITEMS, verbose_errors=False)


class GrammarError(Exception):
    """The grammar does not compile, or the tokens already generated do not fit it."""


class Grammars:
    """One model's tokenizer as llguidance sees it, and its compiled grammars."""

    def __init__(self, model_dir: Path, eos_token_ids: list[int], vocab_size: int) -> None:
        from llguidance import LLTokenizer

        text = (model_dir / "tokenizer.json").read_text()
        self.tokenizer = LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_token_ids or None)
        self.vocab_size = vocab_size
        self.stop_ids = eos_token_ids
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def compiled(self, lark: str) -> bool:
        return lark in self._compiled

    def compile(self, lark: str) -> Any:
        """The grammar compiled, not kept (:meth:`keep`): safe in another thread, and llguidance
        drops the GIL while it compiles, so the engine's loop goes on meanwhile."""
        from llguidance import LLMatcher

        template = LLMatcher(self.tokenizer, LLMatcher.grammar_from_lark(lark), log_level=0, limits=parser_limits())
        if template.is_error():
            raise GrammarError(template.get_error())
        return template

    def keep(self, lark: str, template: Any) -> None:
        self._compiled[lark] = template
        while len(self._compiled) > GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)

    def matcher(self, lark: str) -> Any:
        """A fresh matcher for this grammar (compiled on first use, copied after)."""
        template = self._compiled.get(lark)
        if template is None:
            template = self.compile(lark)
            self.keep(lark, template)
        else:
            self._compiled.move_to_end(lark)
        return template.deep_copy()

    def mask(self, lark: str, generated: list[int]) -> GrammarMask:
        matcher = self.matcher(lark)
        # A resumed request: the grammar state after the tokens it already has.
        if generated and not matcher.consume_tokens(generated):
            raise GrammarError(f"the generated tokens do not fit the grammar: {matcher.get_error()}")
        return GrammarMask(matcher, self.vocab_size, self.stop_ids)


class GrammarMask:
    """mlx-lm logits processor: ``(tokens, logits) -> logits`` with disallowed tokens at -inf.

    mlx-lm samples a token one step before it reports it, and hands each processor
    the sequence so far: the matcher consumes the tokens it has not yet seen from
    there (none on the first call, which follows the prompt)."""

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: list[int]) -> None:
        from llguidance.numpy import allocate_token_bitmask

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = allocate_token_bitmask(1, vocab_size)
        self.seen: int | None = None
        self.stop_ids = stop_ids
        # Why the matcher cannot go on (an error, or its per-step budget spent): the worker
        # fails the request rather than let an output end that the grammar did not finish.
        self.failure: str | None = None

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx
        import numpy as np  # here, not at the top: the server process imports this module's users
        from llguidance.numpy import fill_next_token_bitmask

        length = int(tokens.shape[-1])
        if self.seen is not None and length > self.seen:
            new = [int(t) for t in tokens[self.seen :].tolist()]
            if not self.matcher.is_stopped():  # a finished grammar has only end-of-sequence left
                self.matcher.consume_tokens(new)
        self.seen = length
        fill_next_token_bitmask(self.matcher, self.bitmask)
        allowed = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
        if self.matcher.is_error() or not allowed.any():
            # The matcher failed (its mask then holds only end-of-sequence): this step ends
            # the output, and the worker fails the request, whose output is not complete.
            error = self.matcher.get_error().strip()
            self.failure = error.splitlines()[0] if error else "no token can follow the output under its grammar"
            allowed[:] = 0
            allowed[[i for i in self.stop_ids if i < self.vocab_size]] = 1
        width = logits.shape[-1]
        if width > self.vocab_size:  # embedding rows past the tokenizer are never text
            allowed = np.concatenate([allowed, np.zeros(width - self.vocab_size, dtype=np.uint8)])
        return mx.where(mx.array(allowed[:width].astype(np.bool_)), logits, mx.array(-float("inf"), logits.dtype))
