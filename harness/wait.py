"""Waiting for a state: the one polling loop of the tests, always with a deadline.

A test asserts a state once the event that proves it has happened, never after a sleep
that hopes it has: ``wait_until`` polls a condition until it holds and fails, saying what
it waited for, once the deadline passes. The deadline only stops a broken run; a passing
run never waits longer than the condition takes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

INTERVAL_SECS = 0.02
TIMEOUT_SECS = 60.0


def _failure(what: str | Callable[[], object], timeout: float) -> AssertionError:
    return AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")


def wait_until(
    condition: Callable[[], T | None],
    what: str | Callable[[], object] = "the condition",
    *,
    timeout: float = TIMEOUT_SECS,
    interval: float = INTERVAL_SECS,
) -> T:
    """Call ``condition`` until it returns something true, and return that. ``what`` names
    the awaited state in the failure (a callable: evaluated only then, e.g. to read a log)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise _failure(what, timeout)
        time.sleep(interval)
    return value


@overload
async def wait_until_async(
    condition: Callable[[], Awaitable[T | None]],
    what: str | Callable[[], object] = ...,
    *,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...


@overload
async def wait_until_async(
    condition: Callable[[], T | None],
    what: str | Callable[[], object] = ...,
    *,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...


async def wait_until_async(
    condition: Callable[[], Any],
    what: str | Callable[[], object] = "the condition",
    *,
    timeout: float = TIMEOUT_SECS,
    interval: float = INTERVAL_SECS,
) -> Any:
    """``wait_until`` on an event loop: the loop runs while it waits (for state that the
    loop's own tasks change). ``condition`` may be a coroutine function (a database read)."""
    deadline = time.monotonic() + timeout

    async def check() -> Any:
        found = condition()
        return await found if inspect.isawaitable(found) else found

    while not (value := await check()):
        if time.monotonic() >= deadline:
            raise _failure(what, timeout)
        await asyncio.sleep(interval)
    return value
