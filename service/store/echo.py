"""The reasoning echo's store: reasoning items by (owner, turn key), bounded in bytes (LRU).

Rows are keyed by content, not by response, so deleting a response leaves them; the byte
bound alone keeps the table small. Writes are jobs for the group-committing writer:
:meth:`EchoStore.job` is meant to ride in the transaction that finishes a task, so
remembering costs no commit of its own, and a failure in it never fails that transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import msgspec

from lmspd.store.conn import Conn
from lmspd.store.db import Database

log = logging.getLogger("lmspd.store.echo")


def _evict(conn: Conn, budget: int) -> int:
    """Drop least recently used rows until the total fits ``budget``; returns rows dropped."""
    excess = conn.run("echo_bytes").fetchone()[0] - budget
    if excess <= 0:
        return 0
    victims: list[tuple[str, str]] = []
    for row in conn.run("echo_oldest"):
        victims.append((row["owner"], row["key"]))
        excess -= row["size"]
        if excess <= 0:
            break
    for owner, key in victims:
        conn.run("echo_delete", {"owner": owner, "key": key})
    return len(victims)


class EchoStore:
    def __init__(self, db: Database, max_bytes: int) -> None:
        self.db = db
        self.max_bytes = max_bytes

    async def lookup(self, owner: str, keys: Sequence[str]) -> dict[str, bytes]:
        """The owner's remembered items for ``keys`` (those it has)."""
        if not keys:
            return {}
        params = {"owner": owner, "keys": msgspec.json.encode(list(keys)).decode()}
        return {r["key"]: bytes(r["item"]) for r in await self.db.all("echo_lookup", params)}

    def job(
        self, owner: str, remember: Sequence[tuple[str, bytes]], touch: Sequence[str] = ()
    ) -> Callable[[Conn], None]:
        """A write job: store ``remember`` (key, item JSON) pairs, mark ``touch`` keys used,
        then evict down to the budget. An item larger than the whole budget is not stored.
        Runs in its own savepoint and swallows the database's errors (logged): the echo is an
        optimisation, and the transaction it rides in must not fail for it."""
        fits = [(key, item) for key, item in remember if len(item) <= self.max_bytes]
        budget = self.max_bytes

        def run(conn: Conn) -> None:
            conn.execute("SAVEPOINT echo")
            try:
                for key in touch:
                    conn.run("echo_touch", {"owner": owner, "key": key})
                for key, item in fits:
                    conn.run("echo_put", {"owner": owner, "key": key, "item": item})
                _evict(conn, budget)
            except conn.Error:
                log.exception("reasoning echo: not remembered")
                conn.execute("ROLLBACK TO echo")
            conn.execute("RELEASE echo")

        return run

    async def remember(self, owner: str, remember: Sequence[tuple[str, bytes]], touch: Sequence[str] = ()) -> None:
        await self.db.writer.submit(self.job(owner, remember, touch))

    async def enforce(self) -> int:
        """Evict down to the budget (after it was lowered); returns rows dropped."""
        budget = self.max_bytes
        return await self.db.writer.submit(lambda conn: _evict(conn, budget))

    async def total_bytes(self) -> int:
        row = await self.db.one("echo_bytes")
        return int(row[0]) if row else 0
