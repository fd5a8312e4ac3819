"""One reasoning key for every node on one PostgreSQL (store/secrets.py): made by the first node
that asks, the same bytes for all, so a reasoning item sealed on one node opens on another."""

from __future__ import annotations

import asyncio

from lmspd.responses.sealing import KEY_FILE, Sealer
from lmspd.store import secrets
from lmspd.store.opening import open_database
from lmspd.store.url import StoreUrl


async def test_every_node_gets_the_first_nodes_key_and_opens_its_seals(pg_url: str) -> None:
    url = StoreUrl.parse(pg_url, None)  # type: ignore[arg-type]
    dbs = [await open_database(url) for _ in range(3)]
    try:
        made: list[bytes] = []

        def make() -> bytes:
            made.append(Sealer.new_key())
            return made[-1]

        # Three nodes starting at once: each offers a key of its own, one wins for all.
        keys = await asyncio.gather(*(secrets.shared(db, KEY_FILE, make) for db in dbs))
        assert len(made) == 3 and len(set(made)) == 3
        assert len(set(keys)) == 1 and keys[0] in made and len(keys[0]) == 32
        # A restarted node reads the same key again.
        assert await secrets.shared(dbs[0], KEY_FILE, Sealer.new_key) == keys[0]
        a, b = Sealer(keys[1]), Sealer(keys[2])
        token = a.seal("alice", "rs_1", "thinking about it")
        opened = b.open("alice", token, "input[0].encrypted_content")
        assert (opened.id, opened.text) == ("rs_1", "thinking about it")
    finally:
        for db in dbs:
            await db.close()
