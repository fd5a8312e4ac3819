"""Generation metrics as the engine's events arrive (the supervisor feeds one per generation)."""

from __future__ import annotations

import time

from lmspd.engine import protocol as p
from lmspd.metrics import Metrics


class TokenTimer:
    """A generation's metrics, as its events arrive from the engine: time to the first
    token, time per later token, tokens generated; at the end, the finish reason and the
    prompt cache's share of the prompt."""

    def __init__(self, metrics: Metrics, task_id: str) -> None:
        self.metrics = metrics
        self.task_id = task_id
        self.last = time.perf_counter()  # the Generate is sent when the stream is first read
        self.first = True
        self.ttft = 0.0
        self.later_tokens = 0  # tokens after the first delta, and the seconds they took
        self.later_secs = 0.0

    def saw(self, ev: p.Delta | p.Finished) -> None:
        m = self.metrics
        if isinstance(ev, p.Finished):
            m.generations_finished.labels(ev.reason).inc()
            if not self.first:  # it produced tokens: the console's recent speed counts it
                m.recent.add(self.ttft, self.later_tokens, self.later_secs)
            if ev.reason != "cancelled":  # an early cancel never reached the engine
                m.prompt_tokens.inc(ev.prompt_tokens)
                if ev.cached_tokens:
                    m.prompt_cache_hits.inc()
                    m.prompt_cached_tokens.inc(ev.cached_tokens)
            return
        if not (n := len(ev.token_ids)):
            return
        now = time.perf_counter()
        m.output_tokens.inc(n)
        if self.first:
            self.first = False
            self.ttft = now - self.last
            m.time_to_first_token.observe(self.ttft)
            m.first_token_stages.mark(self.task_id, "engine")
        else:
            for _ in range(n):
                m.token_latency.observe((now - self.last) / n)
            self.later_tokens += n
            self.later_secs += now - self.last
        self.last = now
