"""How many prompt tokens one engine step may prefill.

mlx-lm's ``BatchGenerator`` alternates one decode step of the running requests with one
prefill chunk of the waiting ones, so the chunk size is how long the running streams wait
between two tokens. A fixed chunk (512 tokens) is right when nothing is decoding and far too
long when something is: on a CPU one such chunk takes seconds. The pacer sizes the chunk to a
time budget from the prefill rate it measures, so a stream keeps getting tokens while a long
prompt is admitted, and a prompt alone still prefills in full-size chunks.
"""

from __future__ import annotations

# Below this a chunk is mostly fixed per-step cost; the rate it measures would shrink the next.
MIN_STEP = 16
# Weight of the newest measurement in the prefill rate (an exponential moving average).
SMOOTHING = 0.5


class PrefillPacer:
    def __init__(self, max_step: int, budget_s: float) -> None:
        self.max_step = max_step
        self.budget_s = budget_s
        self.rate: float | None = None  # prompt tokens per second, as measured

    def step_size(self, decoding: bool) -> int:
        """The prefill chunk for the next step: full size unless streams are waiting on it."""
        if not decoding or self.budget_s <= 0:
            return self.max_step
        if self.rate is None:  # nothing measured yet: start small, the rate grows it
            return min(MIN_STEP, self.max_step)
        return max(min(int(self.rate * self.budget_s), self.max_step), min(MIN_STEP, self.max_step))

    def observe(self, tokens: int, seconds: float) -> None:
        """One step's prefill work. The rate converges to the chunk whose step takes the
        budget, since a chunk's time grows with its size."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.rate = rate if self.rate is None else SMOOTHING * rate + (1 - SMOOTHING) * self.rate
