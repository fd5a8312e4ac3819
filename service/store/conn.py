"""What a write job sees of the database, the same on SQLite and on PostgreSQL.

A job is a small synchronous function run inside the writer's transaction (docs/reliability.md,
"Group commit"). It names its queries (``conn.run("insert_task", params)``), so one job runs on
either database with the SQL of that database's file (``queries.sql``, ``queries_pg.sql``).
Rows read either way answer by column name and by position, as :class:`sqlite3.Row` does.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from lmspd.store.queries import queries

T = TypeVar("T")
Params = Mapping[str, Any] | Sequence[Any]


class Row(Protocol):
    def __getitem__(self, key: int | str) -> Any: ...
    def keys(self) -> list[str]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Conn(Protocol):
    """The writer's connection, inside a transaction."""

    dialect: str  # "sqlite" or "postgresql"
    # The driver's base error: a job that swallows its own failure (the reasoning echo) catches it.
    Error: type[Exception]

    def execute(self, sql: str, params: Params = ()) -> Cursor: ...
    def run(self, name: str, params: Params = ()) -> Cursor: ...
    def run_many(self, name: str, rows: Iterable[Params]) -> None: ...


Job = Callable[[Conn], Any]


class SqliteConn:
    """:class:`Conn` over the SQLite writer's connection (on aiosqlite's thread)."""

    dialect = "sqlite"
    Error: type[Exception] = sqlite3.Error
    release_savepoints = True

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.raw = conn
        self._q = queries("sqlite")

    def execute(self, sql: str, params: Params = ()) -> sqlite3.Cursor:
        return self.raw.execute(sql, params)

    def run(self, name: str, params: Params = ()) -> sqlite3.Cursor:
        return self.raw.execute(self._q[name], params)

    def run_many(self, name: str, rows: Iterable[Params]) -> None:
        self.raw.executemany(self._q[name], rows)

    @property
    def in_transaction(self) -> bool:
        return self.raw.in_transaction

    def begin(self) -> None:
        self.raw.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.raw.execute("COMMIT")

    def rollback(self) -> None:
        self.raw.execute("ROLLBACK")
