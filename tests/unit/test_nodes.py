"""Nodes on one real PostgreSQL (store/nodes.py, queries_pg.sql): leases and their epochs, the
claim, fencing of a node whose lease was taken over, take-over by one survivor only, and
LISTEN/NOTIFY after commit. Each "node" is a Database of its own (its own connections)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from harness.wait import wait_until_async
from lmspd.errors import LeaseLostError, QueueFullError
from lmspd.store.nodes import NodeStore
from lmspd.store.opening import open_database
from lmspd.store.pg import PgDatabase
from lmspd.store.task_store import Fence, NewEvent, ResponseFields, TaskRecord, TaskStore
from lmspd.store.url import StoreUrl


def event(etype: str):  # type: ignore[no-untyped-def]
    def build(task: TaskRecord, seq: int) -> NewEvent:
        return NewEvent(etype, msgspec.json.encode({"type": etype, "sequence_number": seq}))

    return build


class Node:
    def __init__(self, db: PgDatabase, name: str, lease: float) -> None:
        self.db = db
        self.store = TaskStore(db)
        self.nodes = NodeStore(db, name, lease)

    async def join(self, models: tuple[str, ...] = ("tiny",)) -> Fence:
        self.store.fence = await self.nodes.register(host="h", pid=1, url="http://x", models=models)
        return self.store.fence


@pytest.fixture
async def nodes(pg_url: str) -> AsyncIterator[list[Node]]:
    url = StoreUrl.parse(pg_url, None)  # type: ignore[arg-type]
    dbs = [await open_database(url) for _ in range(3)]
    assert all(isinstance(db, PgDatabase) for db in dbs)
    # Node a's lease is short: the tests let it expire; b's and c's outlive them.
    yield [Node(db, name, lease) for db, name, lease in zip(dbs, "abc", (0.5, 60, 60), strict=True)]  # type: ignore[arg-type]
    for db in dbs:
        await db.close()


async def create(store: TaskStore, fields: ResponseFields | None = None) -> TaskRecord:
    task, _ = await store.create(
        owner="o", request=b"{}", on_restart="resume", first_event=event("response.created"), response=fields
    )
    return task


def asking(model: str = "tiny", **fields: str) -> ResponseFields:
    return ResponseFields(kind="task", model=model, **fields)  # type: ignore[arg-type]


async def run_to_the_end(node: Node, task: TaskRecord) -> None:
    for step in ("loading", "running", "succeeded"):
        assert await node.store.transition(task.id, step) is not None


async def test_a_node_restarting_gets_a_new_epoch_and_fences_its_old_run(nodes: list[Node]) -> None:
    a, b, _ = nodes
    old = await a.join()
    task = await create(a.store)
    assert await a.store.transition(task.id, "loading") is not None
    claimed = await a.store.get(task.id)
    assert (claimed.node, claimed.epoch) == ("a", old.epoch)
    new = await a.join()  # the same node id started again
    assert new.epoch is not None and old.epoch is not None and new.epoch > old.epoch
    assert (await a.store.get(task.id)).epoch == new.epoch  # its own again, under the new epoch
    assert not await a.nodes.heartbeat(old, 0, [])  # the old run's lease is gone
    assert await a.nodes.heartbeat(new, 0, [])
    a.store.fence = old
    with pytest.raises(LeaseLostError):
        await a.store.append_events(task.id, [event("stale")])
    assert await a.store.transition(task.id, "running") is None
    await b.join()
    assert await b.store.transition(task.id, "running") is None  # another node's task: fenced too
    assert (await b.store.get(task.id)).status == "loading"


async def test_one_survivor_takes_over_a_dead_nodes_tasks(nodes: list[Node]) -> None:
    a, b, c = nodes
    fence_a = await a.join()
    await b.join()
    await c.join()
    tasks = [await create(a.store) for _ in range(4)]
    for task in tasks[:3]:
        assert await a.store.transition(task.id, "running", via="loading") is not None
    await wait_until_async(lambda: _expired(b), "node a's lease to expire", timeout=10)
    taken = await asyncio.gather(b.nodes.take_over("a", b.store.fence), c.nodes.take_over("a", c.store.fence))
    assert sorted(taken[0] + taken[1]) == sorted(t.id for t in tasks[:3])
    assert [] in taken  # one survivor took them all, the other found nothing
    winner = b if taken[0] else c
    assert {(await winner.store.get(t.id)).node for t in tasks[:3]} == {"b" if winner is b else "c"}
    assert (await a.store.get(tasks[3].id)).node is None  # a queued task was nobody's
    # Node a comes back (it was only paused): it writes nothing into what it lost.
    with pytest.raises(LeaseLostError):
        await a.store.append_events(tasks[0].id, [event("late")])
    assert await a.store.transition(tasks[1].id, "succeeded") is None
    assert not await a.nodes.heartbeat(fence_a, 0, [])
    assert [e.type for e in await a.store.events_after(tasks[0].id, -1)] == ["response.created"]
    # The new holder moves them by its lease.
    assert await winner.store.requeue(tasks[0].id, new_attempt=False) is not None
    requeued = await winner.store.get(tasks[0].id)
    assert (requeued.status, requeued.node, requeued.epoch) == ("queued", None, None)


async def _expired(node: Node) -> bool:
    return "a" in await node.nodes.expired()


async def test_each_queued_task_is_claimed_by_one_node(nodes: list[Node]) -> None:
    for node in nodes:
        await node.join()
    tasks = [await create(nodes[0].store) for _ in range(20)]
    claims = await asyncio.gather(
        *(node.store.transition(t.id, "loading") for t in tasks for node in nodes),
    )
    won = [claim for claim in claims if claim is not None]
    assert sorted(t.id for t in won) == sorted(t.id for t in tasks)  # each once, by someone
    for task in won:
        assert task.node in ("a", "b", "c") and task.epoch is not None


async def test_a_node_clears_only_its_own_finished_unstored_responses(nodes: list[Node]) -> None:
    """At start a node removes the foreground store:false responses a crash left finished: its
    own, never another node's, whose reader may still be streaming it."""
    a, b, _ = nodes
    await a.join()
    await b.join()
    task, _ = await a.store.create(
        owner="o",
        request=b"{}",
        on_restart="fail",
        first_event=event("response.created"),
        response=ResponseFields(background=False, stored=False),
    )
    for step in ("loading", "running", "succeeded"):
        assert await a.store.transition(task.id, step) is not None
    assert await b.store.delete_finished_unstored() == 0
    assert (await b.store.get(task.id)).status == "succeeded"
    assert await a.store.delete_finished_unstored() == 1


async def test_listeners_hear_commits_of_other_nodes(nodes: list[Node]) -> None:
    a, b, _ = nodes
    await a.join()
    heard: list[str] = []
    gaps: list[int] = []
    listener = asyncio.create_task(b.db.listen("lmspd", heard.append, lambda: gaps.append(1)))
    try:
        await wait_until_async(lambda: bool(gaps), "the listener to start", timeout=10)
        task = await create(a.store)
        await a.store.append_events(task.id, [event("e1")])
        assert await a.store.cancel(task.id, "o", final_events=[event("response.cancelled")])
        expected = [f"q:{task.id}", f"e:{task.id}", f"s:{task.id}:cancelled"]
        await wait_until_async(lambda: all(x in heard for x in expected), lambda: f"{expected} in {heard}", timeout=10)
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)


async def test_a_node_claims_only_the_models_it_serves(nodes: list[Node]) -> None:
    a, b, c = nodes
    await a.join(("tiny",))
    await b.join(("big", "tiny"))
    await c.join(("tiny",))
    big = await create(a.store, asking("big"))
    assert big.model == "big"
    for node in (a, c):  # neither serves it: not even tried, and a claim finds nothing
        assert big.id not in await node.store.queued_ids(10)
        assert await node.store.transition(big.id, "loading") is None
    assert (await a.store.get(big.id)).status == "queued"
    assert big.id in await b.store.queued_ids(10)
    claimed = await b.store.transition(big.id, "loading")
    assert claimed is not None and claimed.node == "b"
    # A model no live node serves is anyone's (it is refused at intake unless some node served it
    # then): it must not wait for a node that may never come.
    odd = await create(a.store, asking("odd"))
    assert odd.id in await a.store.queued_ids(10)
    assert (await a.store.transition(odd.id, "loading")) is not None
    assert await a.nodes.live_models() == {"big", "tiny"}


async def test_the_node_holding_the_prompt_cache_is_preferred_then_anyone(nodes: list[Node]) -> None:
    _, b, c = nodes
    for node in nodes:
        await node.join()
    first = await create(c.store, asking(cache_key="k"))
    await run_to_the_end(b, first)  # b's prompt cache holds "k", and first's turn
    by_key = await create(c.store, asking(cache_key="k"))
    by_turn = await create(c.store, ResponseFields(kind="task", model="tiny", previous_response_id=first.response_id))
    plain = await create(c.store, asking())
    assert (by_key.affinity, by_turn.affinity, plain.affinity) == ("b", "b", None)
    c.store.affinity_hold = 3600.0  # a long wait: the holder is preferred while it is live
    assert await c.store.queued_ids(10) == [plain.id]
    assert await c.store.transition(by_key.id, "loading") is None
    assert await b.store.queued_ids(10) == [by_key.id, by_turn.id, plain.id]
    assert (await b.store.transition(by_key.id, "loading")) is not None
    # The holder did not take by_turn within the wait (it was busy): anyone takes it after it.
    c.store.affinity_hold = 0.0
    assert await c.store.queued_ids(10) == [by_turn.id, plain.id]
    claimed = await c.store.transition(by_turn.id, "loading")
    assert claimed is not None and claimed.node == "c"


async def test_a_dead_holder_is_not_waited_for(nodes: list[Node]) -> None:
    a, b, _ = nodes
    await a.join()  # a's lease is short: it lapses, as a dead node's does
    await b.join()
    first = await create(b.store, asking(cache_key="k"))
    await run_to_the_end(a, first)
    second = await create(b.store, asking(cache_key="k"))
    b.store.affinity_hold = 3600.0
    assert second.affinity == "a" and await b.store.queued_ids(10) == []
    await wait_until_async(lambda: _expired(b), "node a's lease to expire", timeout=10)
    assert await b.store.queued_ids(10) == [second.id]  # at once: a is not live
    assert (await b.store.transition(second.id, "loading")) is not None


async def test_the_queue_bound_holds_across_nodes(nodes: list[Node]) -> None:
    """Each node's writer sees only its own uncommitted tasks: without the intake lock three
    nodes creating at once would each count a queue with room and together overshoot it."""
    for node in nodes:
        await node.join()
        node.store.max_queued = 20
    tries = [create(node.store) for node in nodes for _ in range(15)]
    results = await asyncio.gather(*tries, return_exceptions=True)
    made = [r for r in results if isinstance(r, TaskRecord)]
    refused = [r for r in results if isinstance(r, QueueFullError)]
    assert (len(made), len(refused)) == (20, 25), [r for r in results if not isinstance(r, TaskRecord | QueueFullError)]
    assert await nodes[0].store.queued_ids(100) == sorted(t.id for t in made)
