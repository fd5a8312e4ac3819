"""DecodeSlots (lmspd.models.slots): at most ``limit`` generations of a model at once, the rest
waiting in arrival order; a replaced engine's slots held until they are given back while the next
engine's are free (docs/lmsp.md §7.2)."""

from __future__ import annotations

import asyncio

from lmspd.models.slots import DecodeSlots


async def settle() -> None:
    """Let every task that can run, run (none of them waits on anything but the slots)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_model_runs_at_most_limit_at_once_the_rest_in_arrival_order() -> None:
    async def run() -> None:
        slots = DecodeSlots(2)
        assert not await slots.acquire("a", "m") and not await slots.acquire("b", "m")  # free: no wait
        assert not await slots.acquire("a", "m")  # a holder holds one at most
        assert not await slots.acquire("x", "other")  # another model's batch is its own
        admitted: list[str] = []

        async def wait(holder: str) -> None:
            assert await slots.acquire(holder, "m")  # it waited
            admitted.append(holder)

        waiters = [asyncio.create_task(wait(h)) for h in ("c", "d", "e")]
        await settle()
        assert admitted == [] and slots.running("m") == 2
        slots.release("b")
        await settle()
        assert admitted == ["c"]
        waiters[1].cancel()  # "d" gives up: "e" is next
        await settle()
        slots.release("a")
        await settle()
        assert admitted == ["c", "e"] and slots.running("m") == 2
        await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(run())


def test_the_next_engine_starts_with_every_slot_free() -> None:
    async def run() -> None:
        slots = DecodeSlots(1)
        await slots.acquire("old", "m")
        waiting = asyncio.create_task(slots.acquire("new", "m"))
        await settle()
        assert not waiting.done()
        slots.next_engine()  # a recycle: "old" finishes on the engine being replaced
        await settle()
        assert waiting.done() and slots.running("m") == 1
        slots.release("old")  # the old engine's slot, given back: the new one is unaffected
        assert slots.running("m") == 1
        assert waiting.result() is True  # it waited

    asyncio.run(run())
