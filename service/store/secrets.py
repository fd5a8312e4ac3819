"""Secrets the nodes on one PostgreSQL share (migrations/postgresql/003_secrets.sql): made by
the first node that asks, read back by every node, so all of them hold the same value."""

from __future__ import annotations

from collections.abc import Callable

from lmspd.store.conn import Conn
from lmspd.store.db import Database


async def shared(db: Database, name: str, make: Callable[[], bytes]) -> bytes:
    """The database's secret ``name``; ``make()``'s value if no node had made it yet."""
    candidate = make()

    def put(conn: Conn) -> None:
        conn.run("secret_put", {"name": name, "value": candidate})

    await db.writer.submit(put)
    row = await db.one("secret_get", {"name": name})
    if row is None:  # the insert above committed or lost to another node's: never absent
        raise RuntimeError(f"secret {name} is missing after it was stored")
    return bytes(row["value"])
