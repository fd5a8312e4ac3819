"""Open the database a ``[store] url`` names: the SQLite file, or PostgreSQL (whose driver is
the optional extra ``lmspd[postgresql]``, imported only then)."""

from __future__ import annotations

from lmspd.store.db import CommitHook, Database
from lmspd.store.url import StoreUrl


async def open_database(where: StoreUrl, *, on_commit: CommitHook | None = None) -> Database:
    if where.dialect == "postgresql":
        from lmspd.store.pg import PgDatabase

        return await PgDatabase.connect(where, on_commit=on_commit)
    assert where.path is not None
    return await Database.open(where.path, on_commit=on_commit)
