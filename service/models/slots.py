"""At most ``max_loaded_models`` models in use at once, so the engine never holds more.

The engine evicts only idle models: a load while every resident model is generating
would go past the bound. So a task (or a compaction) takes a slot for its model before
it loads it and gives it back when it is done. A model already in use is shared; another
waits, in arrival order, until one goes idle (arrival order: a busy model's stream of
tasks cannot starve a waiting one).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


async def admitted(fut: asyncio.Future[None], give_back: Callable[[], None]) -> None:
    """Wait for a queued holder's turn; a waiter cancelled just as it was admitted gives its
    slot back (``give_back``) before the cancellation goes on."""
    try:
        await fut
    except asyncio.CancelledError:
        if fut.done() and not fut.cancelled():
            give_back()
        raise


class ModelSlots:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._holders: dict[str, str] = {}  # holder (a task id) -> model
        self._queue: deque[tuple[str, str, asyncio.Future[None]]] = deque()

    def in_use(self) -> set[str]:
        return set(self._holders.values())

    def holders_of(self, model: str) -> list[str]:
        """Who holds ``model`` now (task ids, or a compaction's or an operator's holder)."""
        return sorted(h for h, m in self._holders.items() if m == model)

    async def acquire(self, holder: str, model: str) -> bool:
        """Take a slot for ``model``; whether it had to wait for one."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((holder, model, fut))
        self._admit()
        waited = not fut.done()
        await admitted(fut, lambda: self.release(holder))
        return waited

    def release(self, holder: str) -> None:
        """Give back ``holder``'s slot (nothing if it holds none)."""
        if self._holders.pop(holder, None) is not None:
            self._admit()

    def _admit(self) -> None:
        while self._queue:
            holder, model, fut = self._queue[0]
            if fut.done():  # its waiter was cancelled
                self._queue.popleft()
                continue
            used = self.in_use()
            if model not in used and len(used) >= self.limit:
                return
            self._queue.popleft()
            self._holders[holder] = model
            fut.set_result(None)


class DecodeSlots:
    """At most ``max_concurrency`` generations of one model on the engine at once, so that a task
    reads ``running`` only while the engine decodes it (docs/lmsp.md §7.2).

    The engine batches each model's requests up to ``max_concurrency`` and holds any more in a
    queue of its own; a task sent there would read ``running`` while it waits. So a task (or a
    compaction) takes a slot for its model before it is claimed ``running`` and sent, and gives it
    back when its generation ends; the rest wait here, ``queued``, in arrival order per model.
    A replaced engine's slots stay held until their generations end, while the next engine starts
    with all of its own free (:meth:`next_engine`: a recycle holds up no waiting task).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._engine = 0  # the current engine, counted from the first
        self._holders: dict[str, tuple[int, str]] = {}  # holder -> (engine, model)
        self._queue: deque[tuple[str, str, asyncio.Future[None]]] = deque()

    def running(self, model: str) -> int:
        """Slots of ``model`` held on the current engine."""
        return sum(1 for held in self._holders.values() if held == (self._engine, model))

    async def acquire(self, holder: str, model: str) -> bool:
        """Take a slot of ``model``, waiting for one if none is free (a holder holds one at most);
        whether it waited."""
        if holder in self._holders:
            return False
        if self.running(model) < self.limit and not any(m == model for _, m, _ in self._queue):
            self._holders[holder] = (self._engine, model)  # no wait, not even one loop turn
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((holder, model, fut))
        await admitted(fut, lambda: self.release(holder))
        return True

    def release(self, holder: str) -> None:
        """Give back ``holder``'s slot (nothing if it holds none)."""
        if self._holders.pop(holder, None) is not None:
            self._admit()

    def next_engine(self) -> None:
        """The engine was replaced: new generations go to the next one, whose batch is empty."""
        self._engine += 1
        self._admit()

    def _admit(self) -> None:
        for entry in list(self._queue):
            holder, model, fut = entry
            if fut.done():  # its waiter was cancelled
                self._queue.remove(entry)
            elif self.running(model) < self.limit:
                self._queue.remove(entry)
                self._holders[holder] = (self._engine, model)
                fut.set_result(None)
