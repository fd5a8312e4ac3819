"""What the engine holds per request and per loaded model, and MLX's buffer-cache bound."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmspd.engine import protocol as p
from lmspd.engine.constraint import GrammarMask, Grammars
from lmspd.engine.logprobs import TokenPieces, top_logprobs
from lmspd.engine.pacing import PrefillPacer
from lmspd.models.tokenizer import IncrementalDetokenizer, Tokenizer

# A prompt whose prefill computed at least this many tokens is cached when its prefill ends
# (shorter ones only with their answer): long enough to be worth a copy of its KV.
KEEP_PREFILL_TOKENS = 256
# ...unless its answer can be at most this many tokens: it is cached when it ends, a few steps
# later, and an early copy would only hold its KV twice meanwhile.
KEEP_SOON_TOKENS = 16
# MLX's buffer cache on the CPU backend, at most (more where a packed model's layers need it).
BUFFER_CACHE_BYTES = 16 << 20
# How often an otherwise idle loop looks for a grammar that has compiled.
COMPILE_POLL_SECS = 0.005


def bound_buffer_cache(nbytes: int = BUFFER_CACHE_BYTES) -> None:
    """On the CPU backend, MLX's buffer cache is bounded: unbounded, it held tens of MB of a
    long prompt's transients; without it, every buffer a prefill allocates layer after layer
    (a packed model dequantizes each matrix) is fresh memory to fault in, and a 38-token
    prompt took 475 ms instead of 300. A few MB of freed buffers, reused, are enough.
    On Metal, where the cache is how buffers are reused, it stays as MLX sets it."""
    import mlx.core as mx

    if not mx.metal.is_available():
        mx.set_cache_limit(nbytes)


@dataclass
class Request:
    cmd: p.Generate
    uid: int
    detok: IncrementalDetokenizer
    completion_tokens: int
    cached_tokens: int = 0  # leading prompt tokens whose KV came from the prompt cache
    decoding: bool = False  # prefill done: it now waits on every prefill step
    held: str = ""  # text withheld because it may be the start of a stop string
    mask: GrammarMask | None = None  # its grammar, when constrained
    # The tokens its first pass ends, while that pass's logprobs are to be kept (prompt_ends.py).
    keep_end: list[int] | None = None


def keeps_early(req: Request) -> bool:
    """Whether a request's prompt is cached as soon as it is prefilled (not only at its end)."""
    computed = len(req.cmd.prompt) + len(req.cmd.generated) - req.cached_tokens
    return computed >= KEEP_PREFILL_TOKENS and req.cmd.max_tokens - len(req.cmd.generated) > KEEP_SOON_TOKENS


@dataclass
class LoadedModel:
    name: str
    path: str
    model: Any
    tokenizer: Tokenizer
    batch: Any  # mlx_lm BatchGenerator
    context_length: int
    vocab_size: int
    weight_dtype: str
    numerics: str  # "exact" or "fast" (docs/numerics.md)
    fingerprint: str  # the prompt cache's namespace for these weights
    pacer: PrefillPacer
    resident_bytes: int = 0
    hosts: list[p.HostShare] = field(default_factory=list)  # its parts over a group of hosts
    kernels: Any = None  # lmspd's kernels' module where they run its products (quantized_float32)
    requests: dict[int, Request] = field(default_factory=dict)
    pieces: TokenPieces | None = None  # built on the first request that asks for logprobs
    grammars: Grammars | None = None  # built on the first constrained request

    def token_pieces(self) -> TokenPieces:
        if self.pieces is None:
            self.pieces = TokenPieces(self.tokenizer)
        return self.pieces

    def score(self, wanted: list[tuple[int, int, Any, int]]) -> dict[int, p.TokenLogprob]:
        """Logprobs of each (uid, token, its logprobs row, how many alternatives), by uid: one
        partial sort for all of them."""
        if not wanted:
            return {}
        chosen, tops = top_logprobs([w[2] for w in wanted], [w[1] for w in wanted], [w[3] for w in wanted])
        pieces = self.token_pieces()
        scored: dict[int, p.TokenLogprob] = {}
        for (uid, token, _, _), logprob, top in zip(wanted, chosen, tops, strict=True):
            alternatives = [p.TopLogprob(*pieces.scored(t, v)) for t, v in top]
            scored[uid] = p.TokenLogprob(*pieces.scored(token, logprob), alternatives)
        return scored

    def grammar_set(self) -> Grammars:
        if self.grammars is None:
            self.grammars = Grammars(Path(self.path), self.tokenizer.eos_token_ids, self.vocab_size)
        return self.grammars

    def grammar_mask(self, grammar: str, generated: list[int]) -> GrammarMask:
        return self.grammar_set().mask(grammar, generated)
