"""One step of every loaded model's batch (continuous batching: requests join and leave
between steps): its prefill paced against its decodes, the prompts it prefilled cached, the
ends of first passes kept (prompt_ends.py), logprobs scored, grammars that cannot go on failed,
and each token handed to its request.

``Stepper`` is handed the ``Residency`` (the models whose batches it steps), the ``Requests``
(what each token does) and the prompt cache; worker.Engine composes it with the rest.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lmspd.engine import protocol as p
from lmspd.engine.loaded import LoadedModel, Request, keeps_early
from lmspd.engine.requests import Requests
from lmspd.engine.residency import Residency

if TYPE_CHECKING:  # it imports MLX, which the server process never does (engine/worker.py)
    from lmspd.engine.prompt_cache import PromptCache

log = logging.getLogger("lmspd.engine")


class Stepper:
    """The batch loop's step: every busy model's batch, one step each."""

    def __init__(self, residency: Residency, requests: Requests, prompt_cache: PromptCache) -> None:
        self.residency = residency
        self.requests = requests
        self.prompt_cache = prompt_cache
        # A failed step ends the engine instead of the batch's requests: in a group of hosts
        # it means a host is lost, and each task then follows its on_restart policy.
        self.fatal = False

    def step(self) -> list[p.Delta]:
        """One step of each model with requests; the deltas of all their tokens."""
        deltas: list[p.Delta] = []
        for lm in list(self.residency.models.values()):
            if lm.requests:
                self.step_model(lm, deltas)
        return deltas

    def step_model(self, lm: LoadedModel, deltas: list[p.Delta]) -> None:
        if lm.kernels is not None:  # its numerics (the process's setting): models loaded together may differ
            lm.kernels.set_numerics(lm.numerics)
        lm.batch.prefill_step_size = lm.pacer.step_size(any(r.decoding for r in lm.requests.values()))
        try:
            with lm.batch.stats() as stats:
                prefilled, responses = lm.batch.next()
        except Exception as exc:  # an MLX failure poisons the whole batch
            if self.fatal:
                raise
            log.exception("decode step failed")
            self.requests.fail_model(lm, f"generation failed: {exc}")
            self.residency.evict_failed(lm)
            return
        lm.pacer.observe(stats.prompt_tokens, stats.prompt_time)
        for r in prefilled:
            if r.end_of_prompt and (req := lm.requests.get(r.uid)) is not None:
                req.decoding = True
        self._keep_prompts(lm, prefilled)
        live = [(r, req) for r in responses if (req := lm.requests.get(r.uid)) is not None]
        self._keep_ends(lm, live)
        live, scored = self._score(lm, live)
        for r, req in live:
            if req.mask is not None and req.mask.failure is not None:
                self.requests.drop(
                    lm,
                    req,
                    f"the output grammar cannot go on: {req.mask.failure}",
                    code="invalid_request",
                    in_batch=r.finish_reason is None,
                )
                continue
            if r.finish_reason is not None and r.prompt_cache is not None:
                self.prompt_cache.store((lm.fingerprint, req.cmd.cache_key), r.all_tokens, r.prompt_cache)
            self.requests.on_token(lm, req, r.token, r.finish_reason, deltas, scored.get(r.uid))

    def _score(
        self, lm: LoadedModel, live: list[tuple[Any, Request]]
    ) -> tuple[list[tuple[Any, Request]], dict[int, p.TokenLogprob]]:
        """The logprobs of the step's tokens, by uid, with the requests still live after them."""
        try:
            # Only the requests that asked pay; a stop token is not output, so it gets no entry.
            scored = lm.score(
                [
                    (r.uid, r.token, r.logprobs, req.cmd.logprobs)
                    for r, req in live
                    if req.cmd.logprobs is not None and r.finish_reason != "stop"
                ],
            )
        except Exception as exc:  # only the requests that asked for logprobs depend on them
            log.exception("logprobs failed")
            for _, req in live:
                if req.cmd.logprobs is not None:
                    self.requests.drop(lm, req, f"logprobs failed: {exc}")
            return [(r, req) for r, req in live if req.cmd.logprobs is None], {}
        return live, scored

    def _keep_ends(self, lm: LoadedModel, live: list[tuple[Any, Request]]) -> None:
        """The logprobs of each request's first pass, which ended its prompt: an exact repeat
        then takes its first token from them (prompt_ends.py)."""
        for r, req in live:
            if req.keep_end is not None:
                self.prompt_cache.ends.keep((lm.fingerprint, req.cmd.cache_key), req.keep_end, r.logprobs)
                req.keep_end = None

    def _keep_prompts(self, lm: LoadedModel, prefilled: list[Any]) -> None:
        """Cache a long prompt as soon as it is prefilled, not only when its answer ends: a
        request sharing it meanwhile, or this one resumed after a crash, skips that work."""
        if not self.prompt_cache.enabled:
            return
        done = [
            r.uid
            for r in prefilled
            if r.end_of_prompt and (req := lm.requests.get(r.uid)) is not None and keeps_early(req)
        ]
        for uid, (cache, tokens) in lm.batch.extract_cache(done).items():
            self.prompt_cache.store((lm.fingerprint, lm.requests[uid].cmd.cache_key), tokens, cache)
