"""This process as one node of several on one PostgreSQL (docs/operations.md, "Several
nodes"): its lease, the other nodes' changes, and the work of nodes that died.

- Joining takes a lease under a new epoch (``store.fence``): every claim and event write of
  this node is fenced by it, and the tasks its previous run left are its own to settle.
- Every ``[cluster] heartbeat_secs`` the lease is renewed. Found taken over (this node was
  paused past ``lease_secs``: a laptop lid, SIGSTOP), every generation here stops at once —
  their tasks are another node's — and the node joins again under a new epoch.
- Each heartbeat also looks for nodes whose lease expired: their unfinished tasks become this
  node's in one transaction, then are settled by their ``on_restart`` policy as after a restart
  (``resume`` ones go back to the queue and continue, on whichever node claims them, from the
  event log).
- LISTEN/NOTIFY brings the other nodes' commits: event readers here wake, a cancel accepted
  elsewhere stops the generation here, a task queued elsewhere wakes the supervisor. The rows
  stay the truth: after a gap in notifications everything waiting reads them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from lmspd.config import Config
from lmspd.core.hub import Hub
from lmspd.core.supervisor import Supervisor
from lmspd.models.catalog import BUILTIN_MODELS
from lmspd.models.pull import is_pulled
from lmspd.store.nodes import NodeInfo, NodeStore
from lmspd.store.pg import PgDatabase
from lmspd.store.task_store import TaskStore

log = logging.getLogger("lmspd.cluster")
CHANNEL = "lmspd"  # migrations/postgresql/002_nodes.sql notifies on it


class Cluster:
    def __init__(self, config: Config, db: PgDatabase, store: TaskStore, hub: Hub) -> None:
        self.config = config
        self.db = db
        self.store = store
        self.hub = hub
        server = config.server
        self.node_id = config.cluster.node_id or f"{socket.gethostname()}:{server.port}"
        self.url = f"http://{server.host}:{server.port}"
        self.nodes = NodeStore(db, self.node_id, config.cluster.lease_secs)
        # A task waits this long for the node holding its prompt cache (docs/operations.md).
        store.affinity_hold = config.cluster.heartbeat_secs
        self.supervisor: Supervisor | None = None
        self._chores: list[asyncio.Task[None]] = []
        self._cancels: set[asyncio.Task[None]] = set()  # held until done (asyncio keeps weak refs)
        self.lost = 0  # leases found taken over
        self.taken_over = 0  # tasks taken over from dead nodes

    def models(self) -> list[str]:
        """What this node serves, as its lease row lists it (claims go by it): its default
        model, its aliases and the built-ins pulled here, by the names requests use."""
        cache = self.config.model_cache_dir
        pulled = [name for name in BUILTIN_MODELS if is_pulled(cache / name)]
        return sorted({self.config.default_model, *self.config.models, *pulled})

    async def live_models(self) -> set[str]:
        return await self.nodes.live_models()

    async def join(self) -> None:
        """Take this node's lease (before recovery: what the node held is then its own) and keep
        it from now on: the engine's start and the preload take longer than a lease."""
        await self._register()
        if not self._chores:
            self._chores.append(asyncio.create_task(self._heartbeat(), name="cluster heartbeat"))

    async def _register(self) -> None:
        self.store.fence = await self.nodes.register(
            host=socket.gethostname(), pid=os.getpid(), url=self.url, models=self.models()
        )
        log.info("node %s joined the cluster (lease epoch %s)", self.node_id, self.store.fence.epoch)
        self.store.metrics.observe_node(self.node_id, self.store.fence.epoch or 0)

    def start(self, supervisor: Supervisor) -> None:
        """Serving: other nodes' changes are heard, dead nodes' tasks taken over."""
        self.supervisor = supervisor
        self._chores.append(
            asyncio.create_task(self.db.listen(CHANNEL, self._heard, self._gap), name="cluster listener")
        )

    async def stop(self) -> None:
        for chore in self._chores:
            chore.cancel()
        await asyncio.gather(*self._chores, return_exceptions=True)
        with contextlib.suppress(Exception):  # the lease then ends by itself
            await self.nodes.leave(self.store.fence)

    async def list(self) -> list[NodeInfo]:
        return await self.nodes.nodes()

    # --- the lease ------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        every = self.config.cluster.heartbeat_secs
        while True:
            await asyncio.sleep(every)
            try:
                await self._beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cluster heartbeat failed: %s", getattr(exc, "message", None) or exc)

    async def _beat(self) -> None:
        supervisor = self.supervisor
        running = len(supervisor.running) if supervisor is not None else 0
        if not await self.nodes.heartbeat(self.store.fence, running, self.models()):
            self.lost += 1
            self.store.metrics.node_leases_lost.inc()
            log.error(
                "node %s: its lease (epoch %s) was taken over by another node: stopping its generations",
                self.node_id,
                self.store.fence.epoch,
            )
            if supervisor is not None:
                await supervisor.lease_lost()
            await self._register()
            if supervisor is not None:
                await supervisor.transitions.recover()
                supervisor.wake()
        self.store.metrics.observe_cluster(*await self.nodes.counts())
        if supervisor is None:
            return  # still starting: taking over dead nodes' work waits until this one serves
        for dead in await self.nodes.expired():
            taken = await self.nodes.take_over(dead, self.store.fence)
            if taken:
                self.taken_over += len(taken)
                self.store.metrics.node_tasks_taken_over.inc(len(taken))
                log.warning("node %s's lease expired: %d unfinished tasks taken over here", dead, len(taken))
                await supervisor.transitions.recover(taken)
                supervisor.wake()

    # --- other nodes' changes -------------------------------------------------------------------

    def _heard(self, payload: str) -> None:
        kind, _, rest = payload.partition(":")
        if kind == "e":
            self.hub.notify(rest)
        elif kind == "s":
            task_id, _, status = rest.rpartition(":")
            self.hub.notify(task_id)
            supervisor = self.supervisor
            if supervisor is not None and status == "cancelling" and task_id in supervisor.running:
                # A cancel accepted on another node: stopped here within a decode step.
                cancel = asyncio.get_running_loop().create_task(supervisor.cancel(task_id))
                self._cancels.add(cancel)
                cancel.add_done_callback(self._cancels.discard)
        elif kind == "q" and self.supervisor is not None:
            self.supervisor.wake()

    def _gap(self) -> None:
        self.hub.notify_all()
        if self.supervisor is not None:
            self.supervisor.wake()
