"""The nodes sharing one PostgreSQL (docs/operations.md, "Several nodes"): each one's
lease row, renewed on the database's clock, and the take-over of a dead node's tasks.

Writes go through the group-committing writer like every other; the lease epoch a registration
returns is the one every claim and event write of this node is fenced by (``Fence``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from lmspd.store.conn import Conn
from lmspd.store.db import Database
from lmspd.store.task_store import Fence


class NodeInfo(msgspec.Struct, kw_only=True):
    """A node as ``GET /lmsp/v1/cluster`` shows it."""

    id: str
    epoch: int
    host: str
    pid: int
    url: str
    models: list[str]
    running: int
    tasks: int  # unfinished tasks it holds
    started_at: int
    heartbeat_at: int
    expires_at: int
    expired: bool


class NodeStore:
    def __init__(self, db: Database, node_id: str, lease_secs: float) -> None:
        self.db = db
        self.node_id = node_id
        self.lease_secs = lease_secs

    async def register(self, *, host: str, pid: int, url: str, models: Sequence[str]) -> Fence:
        """Take (or take back) this node's lease under a new epoch."""
        params = {
            "id": self.node_id,
            "host": host,
            "pid": pid,
            "url": url,
            "models": msgspec.json.encode(list(models)).decode(),
            "lease": self.lease_secs,
        }

        def job(conn: Conn) -> int:
            return int(conn.run("node_register", params).fetchone()[0])

        return Fence(me=self.node_id, epoch=await self.db.writer.submit(job))

    async def heartbeat(self, fence: Fence, running: int, models: Sequence[str]) -> bool:
        """Renew the lease; False: it was taken over (this node must stop what it runs)."""
        params = {
            "id": fence.me,
            "epoch": fence.epoch,
            "lease": self.lease_secs,
            "running": running,
            "models": msgspec.json.encode(list(models)).decode(),
        }

        def job(conn: Conn) -> bool:
            return conn.run("node_heartbeat", params).fetchone() is not None

        return await self.db.writer.submit(job)

    async def expired(self) -> list[str]:
        return [r["id"] for r in await self.db.all("nodes_expired", {"me": self.node_id})]

    async def take_over(self, dead: str, fence: Fence) -> list[str]:
        """The dead node's unfinished tasks, now this node's (none if another survivor was first)."""
        params: dict[str, Any] = {"dead": dead, **fence.params()}

        def job(conn: Conn) -> list[str]:
            return [r[0] for r in conn.run("node_take_over", params).fetchall()]

        return await self.db.writer.submit(job)

    async def leave(self, fence: Fence) -> None:
        def job(conn: Conn) -> None:
            conn.run("node_leave", {"id": fence.me, "epoch": fence.epoch})

        await self.db.writer.submit(job)

    async def nodes(self) -> list[NodeInfo]:
        rows = await self.db.all("nodes_list")
        return [msgspec.convert({k: r[k] for k in r.keys()}, NodeInfo) for r in rows]  # noqa: SIM118

    async def live_models(self) -> set[str]:
        """The models the nodes with a live lease serve, this one's included."""
        return {r["model"] for r in await self.db.all("live_models")}

    async def counts(self) -> tuple[int, int]:
        """Nodes whose lease is live, and those whose lease expired (not yet taken over)."""
        row = await self.db.one("nodes_count")
        return (int(row["live"]), int(row["expired"])) if row else (0, 0)

    async def clock(self) -> float:
        """The database's clock (Unix seconds): what leases are measured by."""
        row = await self.db.one("clock")
        return float(row[0]) if row else 0.0
