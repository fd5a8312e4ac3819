"""PostgreSQL (≥ 15) behind the interface of :class:`lmspd.store.db.Database`.

The driver is psycopg 3 (the optional extra ``lmspd[postgresql]``; docs/operations.md, "Choosing
the driver", has the measurement against asyncpg): its synchronous connection runs the writer's
jobs — the same synchronous jobs as on SQLite — on one thread of its own, in one transaction per
batch (group commit: one ``COMMIT``, one WAL flush, for every job waiting); reads go through an
asynchronous pool (psycopg_pool), each in one round trip, in autocommit (never a transaction
left open across awaits, which would pin an old snapshot).

A deadlock or serialisation failure between nodes rolls the whole batch back and runs it again
(jobs are functions of the database, safe to rerun); a lost connection is made again before the
next batch, and the callers of the batch it broke get 503 (``StoreUnavailableError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from lmspd.errors import LmspdError, StorageFullError, StoreUnavailableError
from lmspd.store.check import DatabaseUnusableError
from lmspd.store.conn import Params
from lmspd.store.db import CommitHook, Database, Job, RetryBatch, Row, Writer, run_batch
from lmspd.store.pg_migrate import latest_version, migrate_pg, schema_version
from lmspd.store.queries import queries
from lmspd.store.url import StoreUrl

try:
    import psycopg
    import psycopg.errors
    import psycopg_pool
    from psycopg.pq import TransactionStatus
except ImportError:  # pragma: no cover - the extra is missing: PgDatabase.connect says so
    psycopg = None  # type: ignore[assignment]

log = logging.getLogger("lmspd.store.pg")

# Each batch is rerun at most this many times after a deadlock between nodes.
BATCH_RETRIES = 3
READERS = 4  # connections of the read pool
CONNECT_TIMEOUT_SECS = 10
IDLE_IN_TRANSACTION_SECS = 5  # below [cluster] lease_secs' default (10)


class PgRow(tuple[Any, ...]):
    """A row read by name or by position, as :class:`sqlite3.Row` is."""

    _names: tuple[str, ...]
    _index: dict[str, int]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._names)


def _row_factory(cursor: Any) -> Any:
    names = tuple(c.name for c in cursor.description or ())
    index = {n: i for i, n in enumerate(names)}

    def make(values: Sequence[Any]) -> PgRow:
        row = PgRow(values)
        row._names, row._index = names, index
        return row

    return make


class PgConn:
    """:class:`lmspd.store.conn.Conn` over the writer's psycopg connection (on its own thread)."""

    dialect = "postgresql"
    release_savepoints = False  # one round trip less per job (store/db.py's run_batch)

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.raw = conn
        self._q = queries("postgresql")
        self.Error: type[Exception] = psycopg.Error

    def execute(self, sql: str, params: Params = ()) -> psycopg.Cursor[Any]:
        return self.raw.execute(sql, params or None)

    def run(self, name: str, params: Params = ()) -> psycopg.Cursor[Any]:
        return self.raw.execute(self._q[name], params or None)

    def run_many(self, name: str, rows: Iterable[Params]) -> None:
        with self.raw.cursor() as cur:
            cur.executemany(self._q[name], list(rows))

    @property
    def in_transaction(self) -> bool:
        return self.raw.info.transaction_status != TransactionStatus.IDLE

    def begin(self) -> None:
        self.raw.execute("BEGIN")

    def commit(self) -> None:
        self.raw.execute("COMMIT")

    def rollback(self) -> None:
        self.raw.execute("ROLLBACK")


def pg_error(exc: BaseException) -> BaseException:
    """A driver's error as the error clients see: a full disk or a lost server is 503."""
    if psycopg is None or not isinstance(exc, psycopg.Error):
        return exc
    if isinstance(exc, psycopg.errors.DiskFull):
        full = StorageFullError("the database server's storage is full: nothing was written; retry later")
        full.__cause__ = exc
        return full
    if isinstance(exc, psycopg.OperationalError | psycopg.errors.AdminShutdown):
        gone = StoreUnavailableError("the database server cannot be reached: nothing was written; retry later")
        gone.__cause__ = exc
        return gone
    return exc


def unusable(url: StoreUrl, cause: str) -> DatabaseUnusableError:
    # libpq's messages name the host and port, never the password.
    first = cause.strip().splitlines()[0] if cause.strip() else "unknown error"
    return DatabaseUnusableError(
        f"the PostgreSQL database {url} cannot be used: {first.rstrip('.')}; run `lmspd doctor` for details"
    )


class PgDatabase(Database):
    dialect = "postgresql"

    def __init__(
        self,
        url: StoreUrl,
        writer_conn: psycopg.Connection[Any],
        pool: psycopg_pool.AsyncConnectionPool[Any],
        executor: ThreadPoolExecutor,
        on_commit: CommitHook | None = None,
    ) -> None:
        self.url = url
        self._conn = writer_conn
        self.pool = pool
        self._executor = executor
        transient = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)

        def batch(jobs: list[Job]) -> list[tuple[bool, Any]]:
            if self._conn.closed or self._conn.broken:
                self._conn = _connect(url)  # the server came back (or we lost only our socket)
            for _ in range(BATCH_RETRIES):
                try:
                    return run_batch(PgConn(self._conn), jobs, transient)
                except RetryBatch:
                    continue
            return run_batch(PgConn(self._conn), jobs)  # the last try: a conflict fails its job

        async def runner(jobs: list[Job]) -> list[tuple[bool, Any]]:
            return await asyncio.get_running_loop().run_in_executor(self._executor, batch, jobs)

        self.writer = Writer(runner, on_commit, errors=pg_error, name="pg-writer")

    @classmethod
    async def connect(cls, url: StoreUrl, *, on_commit: CommitHook | None = None) -> PgDatabase:
        if psycopg is None:
            raise DatabaseUnusableError(
                f"store.url is {url}, but PostgreSQL's driver is not installed: pip install 'lmspd[postgresql]'"
            )
        executor = ThreadPoolExecutor(1, thread_name_prefix="pg-writer")
        loop = asyncio.get_running_loop()
        writer: psycopg.Connection[Any] | None = None
        try:
            writer = await loop.run_in_executor(executor, _connect, url)
            await loop.run_in_executor(executor, migrate_pg, writer)
            pool = psycopg_pool.AsyncConnectionPool(
                url.url,
                min_size=1,
                max_size=READERS,
                kwargs={"autocommit": True, "row_factory": _row_factory},
                open=False,
                timeout=CONNECT_TIMEOUT_SECS,
            )
            await pool.open(wait=True, timeout=CONNECT_TIMEOUT_SECS)
        except BaseException as exc:
            if writer is not None:
                writer.close()
            executor.shutdown(wait=False)
            if isinstance(exc, LmspdError):
                if isinstance(exc, DatabaseUnusableError):
                    raise
                raise unusable(url, exc.message) from exc
            if isinstance(exc, psycopg.Error | psycopg_pool.PoolTimeout | OSError):
                raise unusable(url, str(exc)) from exc
            raise
        return cls(url, writer, pool, executor, on_commit)

    async def fetchone(self, sql: str, params: dict[str, Any] | tuple[Any, ...] = ()) -> Row | None:
        rows = await self.fetchall(sql, params)
        return rows[0] if rows else None

    async def fetchall(self, sql: str, params: dict[str, Any] | tuple[Any, ...] = ()) -> list[Row]:
        try:
            async with self.pool.connection() as conn:
                cur = await conn.execute(sql, params or None)
                return list(await cur.fetchall())
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            raise pg_error(exc) from exc

    async def close(self) -> None:
        await self.writer.close()
        await self.pool.close()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._conn.close)
        self._executor.shutdown(wait=True)

    async def listen(self, channel: str, on_payload: Callable[[str], None], on_gap: Callable[[], None]) -> None:
        """Call ``on_payload`` for each notification on ``channel``, for ever (cancel to stop).
        A lost connection is made again; ``on_gap`` is told each time it is (re)made, as
        notifications sent meanwhile are gone and whoever waits on them must read the rows."""
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.url.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECS
                ) as conn:
                    await conn.execute(f"LISTEN {channel}")
                    on_gap()
                    async for note in conn.notifies():
                        on_payload(note.payload)
            except psycopg.Error as exc:
                log.warning("listening for other nodes' changes: %s; again in 1s", str(exc).strip().splitlines()[0])
                await asyncio.sleep(1.0)

    @contextlib.contextmanager
    def admin(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection of its own (doctor, tests): closed after."""
        conn = _connect(self.url)
        try:
            yield conn
        finally:
            conn.close()


def _connect(url: StoreUrl) -> psycopg.Connection[Any]:
    conn = psycopg.connect(url.url, autocommit=True, row_factory=_row_factory, connect_timeout=CONNECT_TIMEOUT_SECS)
    # Every commit waits for its WAL flush (the default; a server set otherwise is overridden for
    # lmspd's sessions): an acknowledged task is on disk, as on SQLite (docs/reliability.md).
    conn.execute("SET synchronous_commit = on")
    # A writer's transaction lasts milliseconds. One left open by a node that was paused (SIGSTOP,
    # a laptop lid) would hold its row locks, and the keys of the events it was inserting, over
    # the tasks another node took over: the server ends it instead (docs/operations.md).
    conn.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_SECS}s'")
    return conn


def probe(url: StoreUrl) -> int:
    """Connect once and read the schema version, before the service starts anything (``lmspd
    serve`` and ``lmspd doctor``): a server that is down, a wrong password or a database newer
    than this lmspd is refused in one line. Returns the version found (0: none yet)."""
    if psycopg is None:
        raise DatabaseUnusableError(
            f"store.url is {url}, but PostgreSQL's driver is not installed: pip install 'lmspd[postgresql]'"
        )
    try:
        with psycopg.connect(url.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECS) as conn:
            version = schema_version(conn)
    except psycopg.Error as exc:
        raise unusable(url, str(exc)) from exc
    if version > (latest := latest_version()):
        raise unusable(url, f"its schema version is {version}, newer than this lmspd's ({latest}): upgrade lmspd")
    return version


class Inspection(msgspec.Struct, kw_only=True):
    """What ``lmspd doctor`` reports of a PostgreSQL store (read only: nothing is changed)."""

    server_version: str
    schema: int  # 0: no lmspd schema yet (made on the first start)
    latest: int
    skew_secs: float  # the database's clock minus this machine's
    nodes: int
    expired: int


def inspect(url: StoreUrl) -> Inspection:
    """Connect, read the schema version, the server's clock and the nodes' leases."""
    import time

    if psycopg is None:
        raise DatabaseUnusableError("PostgreSQL's driver is not installed: pip install 'lmspd[postgresql]'")
    try:
        with psycopg.connect(url.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECS) as conn:
            before = time.time()
            row = conn.execute("SELECT extract(epoch FROM clock_timestamp()), current_setting('server_version')")
            server_now, server_version = row.fetchone() or (0, "")
            after = time.time()
            version = schema_version(conn)
            nodes = expired = 0
            if (conn.execute("SELECT to_regclass('nodes') IS NOT NULL").fetchone() or (False,))[0]:
                found = conn.execute("SELECT count(*), count(*) FILTER (WHERE expires_at < now()) FROM nodes")
                nodes, expired = found.fetchone() or (0, 0)
    except psycopg.Error as exc:
        raise unusable(url, str(exc)) from exc
    return Inspection(
        server_version=str(server_version),
        schema=version,
        latest=latest_version(),
        skew_secs=float(server_now) - (before + after) / 2,
        nodes=int(nodes),
        expired=int(expired),
    )
