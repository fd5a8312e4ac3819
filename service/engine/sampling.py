"""Sampling with a request's own seed (engine process only: it imports MLX lazily)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmspd.engine import protocol as p


class SeededSampler:
    """mlx-lm's make_sampler, drawing from the request's own PRNG key.

    The global generator is shared by every request in the batch, so a seed set there
    would not make one request reproducible. This key advances once per sampled token;
    a resumed request first advances it once per token it already has, so it continues
    exactly as the uninterrupted run would have.
    """

    def __init__(self, s: p.SamplingParams, seed: int, already: int) -> None:
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        self.temperature = s.temperature
        # The same filters in the same order as make_sampler.
        self.filters: list[Callable[[Any], Any]] = []
        if 0.0 < s.top_p < 1.0:
            self.filters.append(lambda x: apply_top_p(x, s.top_p))
        if s.min_p != 0.0:
            self.filters.append(lambda x: apply_min_p(x, s.min_p))
        if s.top_k > 0:
            self.filters.append(lambda x: apply_top_k(x, s.top_k))
        key = mx.random.key(seed % 2**64)  # a negative seed names a key too
        for n in range(already):
            key = mx.random.split(key)[0]
            if n % 256 == 255:  # keep the lazy chain short for long resumes
                mx.eval(key)
        self.key = key

    def __call__(self, logprobs: Any) -> Any:
        import mlx.core as mx

        for f in self.filters:
            logprobs = f(logprobs)
        self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=draw)
