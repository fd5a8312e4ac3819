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

    async def acquire(self, holder: str, model: str) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((holder, model, fut))
        self._admit()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # admitted just as it was cancelled
                self.release(holder)
            raise

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
