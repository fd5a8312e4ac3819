"""The recent speed ``GET /lmsp/v1/summary`` reports (lmspd.metrics.RecentSpeed): the median
time to first token and the tokens/s after it, over the last generations only."""

from __future__ import annotations

import pytest

from lmspd.metrics import RECENT_GENERATIONS, RecentSpeed


def test_nothing_to_say_before_any_generation() -> None:
    assert RecentSpeed().figures() == (0, None, None)


def test_the_median_and_the_rate_of_the_later_tokens() -> None:
    speed = RecentSpeed()
    speed.add(0.3, 10, 0.5)
    speed.add(0.1, 30, 1.5)
    speed.add(0.2, 0, 0.0)  # a one-token answer: a first token, no rate
    count, ttft, rate = speed.figures()
    assert (count, ttft) == (3, 0.2) and rate == pytest.approx(40 / 2.0)
    speed.add(0.4, 0, 0.0)
    assert speed.figures()[1] == pytest.approx(0.25)  # an even count: the mean of the middle two


def test_only_the_last_generations_count() -> None:
    speed = RecentSpeed()
    speed.add(100.0, 1, 100.0)  # an old, slow one, pushed out
    for _ in range(RECENT_GENERATIONS):
        speed.add(0.05, 20, 0.2)
    count, ttft, rate = speed.figures()
    assert (count, ttft) == (RECENT_GENERATIONS, 0.05) and rate == pytest.approx(100.0)
