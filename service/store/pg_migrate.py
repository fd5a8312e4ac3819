"""PostgreSQL's migrations: ``migrations/postgresql/NNN_name.sql`` (the package
``lmspd.migrations.postgresql``), the version kept in the one-row table ``lmspd_schema``.

Several nodes may start at once against one database: the migration runs under a
transaction-scoped advisory lock, so one of them migrates and the others find it done. A database
newer than this lmspd is refused (an older lmspd must not write into a schema it does not know).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

from lmspd.store.migrate import MigrationError, migrations

# pg_advisory_xact_lock's key: "lmspd" in ASCII, so no other program's lock is taken by chance.
LOCK_KEY = 0x6C6D737064


@cache
def pg_migrations_dir() -> Traversable:
    packaged = resources.files("lmspd.migrations.postgresql")
    if not packaged.is_dir():
        raise MigrationError(f"the migrations folder {packaged} is missing: this lmspd is not installed whole")
    return packaged


def latest_version() -> int:
    return len(migrations(pg_migrations_dir()))


def schema_version(conn: Any) -> int:
    """The database's schema version (0: no lmspd schema in it yet)."""
    exists = conn.execute("SELECT to_regclass('lmspd_schema') IS NOT NULL").fetchone()[0]
    if not exists:
        return 0
    row = conn.execute("SELECT version FROM lmspd_schema").fetchone()
    return int(row[0]) if row else 0


def migrate_pg(conn: Any, directory: Traversable | None = None) -> int:
    """Bring the database to the newest version (``conn``: psycopg, in autocommit)."""
    available = migrations(directory or pg_migrations_dir())
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        conn.execute("CREATE TABLE IF NOT EXISTS lmspd_schema (version integer NOT NULL)")
        current = schema_version(conn)
        if current > len(available):
            raise MigrationError(
                f"its schema version is {current}, newer than this lmspd's ({len(available)}): upgrade lmspd"
            )
        for _, path in available[current:]:
            try:
                conn.execute(path.read_text())
            except Exception as exc:
                raise MigrationError(f"migration postgresql/{path.name} failed: {exc}") from exc
        conn.execute("DELETE FROM lmspd_schema")
        conn.execute("INSERT INTO lmspd_schema (version) VALUES (%s)", (len(available),))
    return len(available)
