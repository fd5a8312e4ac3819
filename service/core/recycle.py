"""Engine recycling: a long-lived engine is replaced while serving, and no task notices.

The engine process grows over weeks (prompt caches, MLX's allocator); a crash is the only
other thing that restarts it. Past ``[engine] recycle_after_secs`` of age, or
``recycle_above_rss_bytes`` of resident memory, or at an operator's call, the supervisor:

1. starts the next engine and gives it the pins and keep-alives, then its preloads;
2. sends every new generation to it from then on (the waiting queue is the supervisor's, so it
   moves by itself: whatever is claimed next runs on the new engine);
3. lets the old engine's running generations finish there, up to ``recycle_drain_secs``;
4. past that, interrupts what is left with :class:`EngineRecycledError`: each such task is put
   back in the queue as ``on_restart: resume`` does, whatever its policy (the server did not
   restart), and continues on the new engine after the tokens it has committed (greedy and
   seeded sampling give the same tokens; none is lost or repeated);
5. closes the old engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from lmspd.config import EngineConfig
from lmspd.engine.process import EngineClient
from lmspd.errors import EngineRecycledError, LmspdError
from lmspd.metrics import Metrics

log = logging.getLogger("lmspd.supervisor")

# How often the supervisor asks the engine for its RSS (when recycle_above_rss_bytes is set).
RSS_CHECK_SECS = 30.0


class Recycler:
    """``current``: the engine serving now; ``serve_on``: sends every new generation to the
    engine it is given, then gives it the pins and keep-alives and the preloads (the
    supervisor's)."""

    def __init__(
        self,
        config: EngineConfig,
        metrics: Metrics,
        current: Callable[[], EngineClient],
        serve_on: Callable[[EngineClient], Awaitable[None]],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.current = current
        self.serve_on = serve_on
        self.started_at = time.monotonic()  # the current engine's start
        self.draining: list[EngineClient] = []  # old engines finishing their generations
        self.replaced = False  # the current engine is one this recycler started (its owner)
        self._task: asyncio.Task[None] | None = None
        self._rss_checked = 0.0

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    async def due(self) -> str | None:
        """Why the engine should be recycled now (None: it should not)."""
        if self.busy:
            return None
        now = time.monotonic()
        if self.config.recycle_after_secs and now - self.started_at >= self.config.recycle_after_secs:
            return "age"
        if self.config.recycle_above_rss_bytes and now - self._rss_checked >= RSS_CHECK_SECS:
            self._rss_checked = now
            with contextlib.suppress(LmspdError):
                if (await self.current().status()).rss_bytes > self.config.recycle_above_rss_bytes:
                    return "rss"
        return None

    def start(self, reason: str) -> bool:
        """Begin a recycle in the background; False if one is already under way."""
        if self.busy:
            return False
        self._task = asyncio.create_task(self._recycle(reason), name="engine recycle")
        return True

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _recycle(self, reason: str) -> None:
        old = self.current()
        log.info("recycling the engine (%s): starting the next one", reason)
        new = EngineClient(old.config, old.cache_dir)
        new.keep_alive = dict(old.keep_alive)
        try:
            await new.start()
        except Exception:
            log.exception("engine recycle: the next engine did not start; the old one serves on")
            await new.close()
            return
        new.listeners = list(old.listeners)
        self.replaced = True
        self.started_at = time.monotonic()
        self.metrics.engine_recycles.labels(reason).inc()
        self.draining.append(old)
        try:
            await self.serve_on(new)
            if not await _within(old.drained(), self.config.recycle_drain_secs):
                n = old.stats()["in_flight"]
                log.info("engine recycle: %d generations still running; resuming them on the next engine", n)
                old.interrupt(EngineRecycledError("the engine was recycled; the task resumes on the next one"))
                await _within(old.drained(), 30.0)
        finally:
            old.listeners.clear()
            await old.close()
            self.draining.remove(old)
            log.info("engine recycled (%s)", reason)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for old in list(self.draining):
            await old.close()


async def _within(work: Awaitable[None], seconds: float) -> bool:
    """Whether ``work`` finished within ``seconds``."""
    try:
        await asyncio.wait_for(work, seconds)
    except TimeoutError:
        return False
    return True
