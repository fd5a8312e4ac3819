"""Admitting a request into its model's batch: validation, waiting for a model or a grammar,
sampling set-up, the prompt cache's hit, and a first token that needs no pass (a kept prompt
end: prompt_ends.py), sent before the batch's next step.

``Admission`` is handed the ``Residency`` (the models it loads and waits for), the
``Requests`` (where a request waits, compiles and runs, and what its first token does) and the
prompt cache; worker.Engine composes it with the rest.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from lmspd.engine import protocol as p
from lmspd.engine.constraint import GrammarError, GrammarMask
from lmspd.engine.loaded import LoadedModel, Request
from lmspd.engine.requests import Requests
from lmspd.engine.residency import Residency
from lmspd.engine.sampling import SeededSampler
from lmspd.errors import LmspdError
from lmspd.models.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # it imports MLX, which the engine loads only after its BLAS (worker.main)
    from lmspd.engine.prompt_cache import Hit, PromptCache

log = logging.getLogger("lmspd.engine")

# The uid of a request answered by its first token alone: it never joins the batch, and is
# gone again before anything else is admitted.
ANSWERED_AT_ONCE = -1


# A pass of up to this many rows carries a decode step's bits (packed.KERNEL_ROWS; this module
# imports nothing of MLX's, which the server process never loads).
DECODE_ROWS = 32


def resumed_segments(tokens: list[int], cached: int, prompt: int) -> list[list[int]]:
    """A request's tokens after the ``cached`` ones as its prompt segments for the batch (each
    prefilled as passes of its own): the prompt's (but its last token) as one, then the prompt's
    last token and the tokens generated before a resume in pieces of up to ``DECODE_ROWS``. The
    uninterrupted run decoded those one a step; a pass of so few rows computes each as a decode
    step does, so their keys and values, and the answer that goes on from them, are the
    uninterrupted run's bit for bit, on either numerics path (docs/numerics.md)."""
    start = max(cached, prompt - 1)
    head, tail = tokens[cached:start], tokens[start:]
    return ([head] if head else []) + [tail[i : i + DECODE_ROWS] for i in range(0, len(tail), DECODE_ROWS)]


class Admission:
    """From a ``Generate`` command to a request in the batch (or its answer, or its failure)."""

    def __init__(self, residency: Residency, requests: Requests, prompt_cache: PromptCache) -> None:
        self.residency = residency
        self.requests = requests
        self.prompt_cache = prompt_cache
        self._compiler: ThreadPoolExecutor | None = None  # the grammar thread, started on first use

    def submit(self, cmd: p.Generate) -> None:
        if self.requests.taken(cmd.request_id):
            return self.requests.fail(cmd, "invalid_request", f"request id {cmd.request_id} is already running")
        if (refused := self.residency.refusal(cmd.model, cmd.path)) is not None:
            return self.requests.fail(cmd, refused.code, refused.message, "model")  # it would wait forever
        if not self.residency.can_load(cmd.model, cmd.path):
            self.requests.waiting.append(cmd)
            return None
        lm = self.residency.load_or_fail(cmd.model, cmd.path)
        if lm is None:
            # The model exists (it was resolved) but did not load: not a 404.
            return self.requests.fail(cmd, "model_load_failed", f"model '{cmd.model}' could not be loaded", "model")
        tokens = cmd.prompt + cmd.generated
        if (invalid := self._invalid(cmd, lm, tokens)) is not None:
            return self.requests.fail(cmd, *invalid)
        remaining = min(cmd.max_tokens - len(cmd.generated), lm.context_length - len(tokens))
        if remaining <= 0:
            self.requests.send(
                p.Finished(
                    request_id=cmd.request_id,
                    reason="length",
                    prompt_tokens=len(cmd.prompt),
                    completion_tokens=len(cmd.generated),
                )
            )
            return None
        if cmd.grammar and not lm.grammar_set().compiled(cmd.grammar):
            return self._compile(lm, cmd, cmd.grammar)
        try:
            processors = [lm.grammar_mask(cmd.grammar, cmd.generated)] if cmd.grammar else []
        except GrammarError as exc:
            return self.requests.fail(
                cmd, "invalid_request", f"the output grammar cannot be used: {exc}", "text.format"
            )
        self._insert(lm, cmd, tokens, remaining, processors)
        return None

    def compiled(self) -> list[str]:
        """The requests whose grammar has compiled by now, in the order they began."""
        return [rid for rid, (_, future) in self.requests.compiling.items() if future.done()]

    def admit_compiled(self, ready: list[str] | None = None) -> None:
        """Requests whose grammar has compiled join the batch (or fail, if it did not compile);
        ``ready``: exactly these, waited for (a group's rank 0 says which: engine/group)."""
        compiling = self.requests.compiling
        for request_id in self.compiled() if ready is None else ready:
            if request_id not in compiling:
                continue
            cmd, future = compiling.pop(request_id)
            try:
                template = future.result()
            except GrammarError as exc:
                self.requests.fail(cmd, "invalid_request", f"the output grammar cannot be used: {exc}", "text.format")
                continue
            except Exception as exc:
                log.exception("compiling a grammar failed")
                self.requests.fail(cmd, "server_error", f"the output grammar could not be compiled: {exc}")
                continue
            if (lm := self.residency.models.get(cmd.model)) is not None and cmd.grammar is not None:
                lm.grammar_set().keep(cmd.grammar, template)
            self.submit(cmd)

    def admit_waiting(self) -> None:
        """Requests that waited for their model's room, each taken again."""
        waiting = self.requests.waiting
        for _ in range(len(waiting)):
            cmd = waiting.popleft()
            if self.residency.can_load(cmd.model, cmd.path):
                self.submit(cmd)
            else:
                waiting.append(cmd)

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    def _compile(self, lm: LoadedModel, cmd: p.Generate, grammar: str) -> None:
        """A new grammar compiles in the grammar thread; its request joins the batch once it
        has (admit_compiled)."""
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.requests.compiling[cmd.request_id] = (cmd, self._compiler.submit(lm.grammar_set().compile, grammar))

    @staticmethod
    def _invalid(cmd: p.Generate, lm: LoadedModel, tokens: list[int]) -> tuple[str, str, str | None] | None:
        """What is wrong with a request for this model, as (code, message, param); None: nothing."""
        try:
            cmd.sampling.validate()
            p.validate_top_logprobs(cmd.logprobs)
        except LmspdError as exc:
            return exc.code, exc.message, exc.param
        if not cmd.prompt:
            return "invalid_request", "the prompt is empty", "input"
        if any(not 0 <= t < lm.vocab_size for t in tokens):
            # MLX does not bounds-check embedding lookups: an out-of-range id reads garbage.
            return "invalid_request", f"token ids must be in [0, {lm.vocab_size})", "input"
        if cmd.max_tokens < 1:
            return "invalid_request", f"max_tokens must be >= 1, got {cmd.max_tokens}", "max_output_tokens"
        if len(tokens) >= lm.context_length:
            message = f"{len(tokens)} tokens exceed the model's context of {lm.context_length}"
            return "context_length_exceeded", message, "input"
        return None

    def _insert(
        self, lm: LoadedModel, cmd: p.Generate, tokens: list[int], remaining: int, processors: list[GrammarMask]
    ) -> None:
        from mlx_lm.generate import StopSequences
        from mlx_lm.sample_utils import make_sampler

        s = cmd.sampling
        sampler: Any
        if s.seed is not None and s.temperature > 0:
            sampler = SeededSampler(s, s.seed, already=len(cmd.generated))
        else:  # greedy ignores a seed; unseeded sampling draws from MLX's global generator
            sampler = make_sampler(
                temp=s.temperature, top_p=s.top_p if s.top_p < 1.0 else 0.0, top_k=s.top_k, min_p=s.min_p
            )
        stops = StopSequences([[t] for t in cmd.stop_token_ids] or None)
        hit = self.prompt_cache.fetch((lm.fingerprint, cmd.cache_key), tokens)
        first = self._first_token(hit, sampler, cmd, processors)
        if first is None:
            hit = hit.step_back()
        elif first in cmd.stop_token_ids or remaining == 1:
            return self._answer_at_once(lm, cmd, hit, first)
        # The first token is the batch's to run next, as a resumed request's last one.
        run = [[first]] if first is not None else resumed_segments(tokens, hit.cached, len(cmd.prompt))
        (uid,) = lm.batch.insert_segments(
            [run],
            max_tokens=[remaining - (first is not None)],
            caches=[hit.cache] if hit.cache is not None else None,
            # What the cache already holds: the batch reports it back with the finished cache.
            all_tokens=[tokens[: hit.cached]],
            samplers=[sampler],
            logits_processors=[list(processors)],
            stop_sequences=[stops],
        )
        req = self._admit(lm, cmd, uid, hit)
        req.mask = processors[0] if processors else None
        if first is None and not processors and self.prompt_cache.enabled:
            req.keep_end = tokens
        if first is not None:
            self.requests.on_token(lm, req, first, None, self.requests.early, self._score_first(lm, req, hit, first))
        return None

    def _admit(self, lm: LoadedModel, cmd: p.Generate, uid: int, hit: Hit) -> Request:
        req = Request(cmd, uid, IncrementalDetokenizer(lm.tokenizer, cmd.generated), len(cmd.generated))
        # A resumed request's cached tokens are counted against its prompt only.
        req.cached_tokens = min(hit.cached, len(cmd.prompt))
        self.requests.add(lm, req)
        return req

    @staticmethod
    def _first_token(hit: Hit, sampler: Any, cmd: p.Generate, processors: list[GrammarMask]) -> int | None:
        """The first token, sampled from a whole hit's kept logprobs (prompt_ends.py); None
        when it comes from a pass. A grammar's mask applies to a pass's logits, and a resumed
        request's tokens never ended a kept pass."""
        if hit.logprobs is None or processors or cmd.generated:
            return None
        return int(sampler(hit.logprobs[None]).item())

    def _answer_at_once(self, lm: LoadedModel, cmd: p.Generate, hit: Hit, first: int) -> None:
        """A first token that ends the answer (a stop token, or the only one it may have): the
        request never joins the batch."""
        req = self._admit(lm, cmd, ANSWERED_AT_ONCE, hit)
        finish = "stop" if first in cmd.stop_token_ids else "length"
        self.requests.on_token(lm, req, first, finish, self.requests.early, self._score_first(lm, req, hit, first))

    def _score_first(self, lm: LoadedModel, req: Request, hit: Hit, first: int) -> p.TokenLogprob | None:
        if req.cmd.logprobs is None:
            return None
        return lm.score([(req.uid, first, hit.logprobs, req.cmd.logprobs)]).get(req.uid)
