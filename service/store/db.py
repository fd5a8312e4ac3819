"""The database: SQLite in WAL mode (embedded, the default) or PostgreSQL (``store/pg.py``), behind
one interface: a group-committing :class:`Writer` and reads in one hop.

All writes go through :class:`Writer`: callers submit small synchronous jobs
(``store/conn.py``); the writer runs every job that is waiting in one transaction
(each in its own SAVEPOINT, so one failing job fails alone), commits once
(``synchronous=FULL`` on SQLite, PostgreSQL's ``synchronous_commit`` on), and only then
resolves the callers. Many concurrent task submissions thus share one fsync (group
commit), and nothing is acknowledged before it is on disk.

``store/opening.py`` opens the one ``[store] url`` names (docs/operations.md, "Several nodes").
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import aiosqlite

from lmspd.errors import LmspdError, StorageFullError
from lmspd.store.check import DatabaseUnusableError, check, disk_problem, refusal
from lmspd.store.conn import Conn, Job, Row, SqliteConn
from lmspd.store.files import private_dir, private_file
from lmspd.store.migrate import migrate
from lmspd.store.queries import queries

T = TypeVar("T")
__all__ = ["CommitHook", "Conn", "Database", "Job", "Row", "Writer", "on_thread"]
# Told of each group commit: its duration in seconds and its number of jobs (the metrics).
CommitHook = Callable[[float, int], None]
MAX_BATCH = 512
SQLITE_FULL = 13


def sqlite_error(exc: BaseException) -> BaseException:
    """SQLite's "database or disk is full" as the error clients see (503, retry later);
    any other error as it is."""
    if isinstance(exc, sqlite3.Error) and (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF == SQLITE_FULL:
        full = StorageFullError("the server's storage is full: nothing was written; retry later")
        full.__cause__ = exc
        return full
    return exc


def _configure(conn: sqlite3.Connection, writer: bool) -> None:
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA busy_timeout = 5000")
    if writer:
        conn.execute("PRAGMA synchronous = FULL")
        if sys.platform == "darwin":
            conn.execute("PRAGMA fullfsync = ON")  # fsync alone does not reach the platter on macOS


def _read_all(conn: sqlite3.Connection, sql: str, params: dict[str, Any] | tuple[Any, ...]) -> list[sqlite3.Row]:
    return conn.execute(sql, params).fetchall()


class Transactional(Conn, Protocol):
    """A writer's connection that the batch runner begins, commits and rolls back."""

    # False (PostgreSQL): each job's savepoint is left open, the next one nested in it, which
    # saves a round trip per job; ROLLBACK TO still undoes only the newest (the failing) job.
    release_savepoints: bool

    @property
    def in_transaction(self) -> bool: ...
    def begin(self) -> None: ...
    def commit(self) -> None: ...
    def rollback(self) -> None: ...


class RetryBatch(Exception):
    """A job met a transient conflict (PostgreSQL: a deadlock between nodes): the whole
    transaction is rolled back and the batch runs again."""


def run_batch(
    conn: Transactional, jobs: list[Job], transient: tuple[type[BaseException], ...] = ()
) -> list[tuple[bool, Any]]:
    """Run ``jobs`` in one transaction, each in its own savepoint; commit once."""
    results: list[tuple[bool, Any]] = []
    conn.begin()
    try:
        for job in jobs:
            conn.execute("SAVEPOINT job")
            try:
                results.append((True, job(conn)))
                if conn.release_savepoints:
                    conn.execute("RELEASE job")
            except Exception as exc:
                if isinstance(exc, transient):
                    raise RetryBatch from exc
                if not conn.in_transaction:
                    # SQLite rolled the whole transaction back itself (a full disk does that):
                    # nothing in the batch happened, and every job fails with the cause.
                    raise exc from None
                conn.execute("ROLLBACK TO job")
                if conn.release_savepoints:
                    conn.execute("RELEASE job")
                results.append((False, exc))
        conn.commit()
    except BaseException:
        if conn.in_transaction:
            conn.rollback()
        raise
    return results


def _sqlite_batch(conn: sqlite3.Connection, jobs: list[Job]) -> list[tuple[bool, Any]]:
    return run_batch(SqliteConn(conn), jobs)


async def on_thread(conn: aiosqlite.Connection, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(sqlite3_connection, *args)`` on aiosqlite's connection thread in one hop."""
    result: T = await conn._execute(fn, conn._conn, *args)  # type: ignore[no-untyped-call]
    return result


BatchRunner = Callable[[list[Job]], Awaitable[list[tuple[bool, Any]]]]


class Writer:
    """``runner`` runs one batch in one transaction (on the database's writer thread);
    ``errors`` turns a driver's error into the one clients see (a full disk: 503)."""

    def __init__(
        self,
        runner: BatchRunner,
        on_commit: CommitHook | None = None,
        errors: Callable[[BaseException], BaseException] = sqlite_error,
        name: str = "sqlite-writer",
    ) -> None:
        self._runner = runner
        self._errors = errors
        self._on_commit = on_commit
        self._pending: list[tuple[Job, asyncio.Future[Any], bool]] = []
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name=name)
        self.commits = 0

    async def submit(self, job: Callable[[Conn], T], *, first: bool = False) -> T:
        """Run ``job`` inside a write transaction; returns once that transaction committed.
        ``first``: before the batch's other jobs (intake, whose lock on PostgreSQL must come
        before any row lock of its transaction: task_store.py)."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((job, fut, first))
        self._wake.set()
        return await fut

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            if self._pending:
                self._wake.set()
            if not batch:
                continue
            batch.sort(key=lambda pending: not pending[2])  # stable: the rest keep their order
            try:
                # The runner runs the batch on the connection's thread: one hop per batch.
                start = time.perf_counter()
                results = await self._runner([job for job, _, _ in batch])
                seconds = time.perf_counter() - start
                self.commits += 1
            except Exception as exc:  # the COMMIT itself failed: nothing in the batch happened
                for _, fut, _ in batch:
                    if not fut.done():
                        fut.set_exception(self._errors(exc))
                continue
            for (_, fut, _), (ok, value) in zip(batch, results, strict=True):
                if fut.done():
                    continue
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(self._errors(value))
            if self._on_commit is not None:
                with contextlib.suppress(Exception):  # a metric must never stop the writer
                    self._on_commit(seconds, len(batch))

    async def close(self) -> None:
        while self._pending:
            await asyncio.sleep(0.01)
        self._task.cancel()


class Database(ABC):
    """The interface both databases offer (``SqliteDatabase`` here, ``PgDatabase`` in store/pg.py):
    each supplies ``fetchone``, ``fetchall`` and ``close``, and its ``writer``."""

    dialect: ClassVar[str] = "sqlite"
    writer: Writer

    @classmethod
    async def open(
        cls, path: Path, migrations_dir: Path | None = None, *, on_commit: CommitHook | None = None
    ) -> SqliteDatabase:
        """The SQLite file at ``path`` (a ``[store] url`` of either kind: store/opening.py)."""
        return await SqliteDatabase.connect(path, migrations_dir, on_commit=on_commit)

    def q(self, name: str) -> str:
        """The named query in this database's SQL."""
        return queries(self.dialect)[name]

    @abstractmethod
    async def fetchone(self, sql: str, params: dict[str, Any] | tuple[Any, ...] = ()) -> Row | None:
        """The first row ``sql`` reads (None: none)."""

    @abstractmethod
    async def fetchall(self, sql: str, params: dict[str, Any] | tuple[Any, ...] = ()) -> list[Row]:
        """Every row ``sql`` reads."""

    async def one(self, name: str, params: dict[str, Any] | tuple[Any, ...] = ()) -> Row | None:
        return await self.fetchone(self.q(name), params)

    async def all(self, name: str, params: dict[str, Any] | tuple[Any, ...] = ()) -> list[Row]:
        return await self.fetchall(self.q(name), params)

    @abstractmethod
    async def close(self) -> None:
        """Close its connections, once what was written is committed."""


class SqliteDatabase(Database):
    """SQLite in WAL mode: one group-committing writer connection, one reader connection."""

    def __init__(
        self, writer_conn: aiosqlite.Connection, reader: aiosqlite.Connection, on_commit: CommitHook | None = None
    ) -> None:
        self._writer_conn = writer_conn
        self.reader = reader

        async def runner(jobs: list[Job]) -> list[tuple[bool, Any]]:
            return await on_thread(writer_conn, _sqlite_batch, jobs)

        self.writer = Writer(runner, on_commit)

    @classmethod
    async def connect(
        cls, path: Path, migrations_dir: Path | None = None, *, on_commit: CommitHook | None = None
    ) -> SqliteDatabase:
        # Read-only, before anything opens it for writing: a damaged file is refused as it is.
        await asyncio.to_thread(check, path, migrations_dir)
        opened: list[aiosqlite.Connection] = []
        try:
            # Every tenant's prompts and answers: the owner's alone, whatever the umask (SQLite
            # gives the WAL and SHM files the database's mode; docs/operations.md).
            private_dir(path.parent)
            private_file(path)
            writer = await aiosqlite.connect(path, isolation_level=None)
            opened.append(writer)
            await on_thread(writer, _configure, True)
            await on_thread(writer, migrate, migrations_dir)
            reader = await aiosqlite.connect(path, isolation_level=None)
            opened.append(reader)
            await on_thread(reader, _configure, False)
        except BaseException as exc:
            # Each connection is a thread that would keep the process alive after a failed start.
            for conn in opened:
                with contextlib.suppress(Exception):
                    await conn.close()
            if isinstance(exc, DatabaseUnusableError) or not isinstance(exc, sqlite3.Error | OSError | LmspdError):
                raise
            cause = disk_problem(path) or (exc.message if isinstance(exc, LmspdError) else str(exc))
            raise DatabaseUnusableError(refusal(path, cause)) from exc
        return cls(writer, reader, on_commit)

    # Each read runs, and finishes, in one hop on the reader's thread. Cursors left open
    # across awaits would keep one read transaction alive while requests interleave, and
    # in WAL mode that pins an old snapshot: a task committed a moment ago would not be seen.
    async def fetchone(self, sql: str, params: dict[str, Any] | tuple[Any, ...] = ()) -> Row | None:
        rows = await on_thread(self.reader, _read_all, sql, params)
        return rows[0] if rows else None

    async def fetchall(self, sql: str, params: dict[str, Any] | tuple[Any, ...] = ()) -> list[Row]:
        return list(await on_thread(self.reader, _read_all, sql, params))

    async def close(self) -> None:
        await self.writer.close()
        await self.reader.close()
        await self._writer_conn.close()
