"""Apply numbered ``migrations/NNN_name.sql`` files, tracked by ``PRAGMA user_version``.

The files live in the project's ``migrations/`` folder, installed (editable or from the wheel) as
the package ``lmspd.migrations`` and read with ``importlib.resources``. Finding none is an error: an
empty list would silently leave a new database without tables.
"""

from __future__ import annotations

import re
import sqlite3
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable

from lmspd.errors import LmspdError

_FILE = re.compile(r"^(\d+)_[\w-]+\.sql$")


class MigrationError(LmspdError):
    code = "migration_failed"


@cache
def migrations_dir() -> Traversable:
    packaged = resources.files("lmspd.migrations")
    if not packaged.is_dir():
        raise MigrationError(f"the migrations folder {packaged} is missing: this lmspd is not installed whole")
    return packaged


def migrations(directory: Traversable | None = None) -> list[tuple[int, Traversable]]:
    directory = directory or migrations_dir()
    found = sorted(
        ((int(m.group(1)), p) for p in directory.iterdir() if (m := _FILE.match(p.name))), key=lambda np: np[0]
    )
    if not found:
        raise MigrationError(f"no migrations found in {directory}: this lmspd is not installed whole")
    numbers = [n for n, _ in found]
    if numbers != list(range(1, len(numbers) + 1)):
        raise MigrationError(f"migrations in {directory} must be numbered 1..N without gaps, found {numbers}")
    return found


def migrate(conn: sqlite3.Connection, directory: Traversable | None = None) -> int:
    """Bring the database to the newest version; each migration commits with its version bump."""
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    available = migrations(directory)
    if current > len(available):
        raise MigrationError(f"database is at version {current}, newer than this lmspd ({len(available)})")
    for number, path in available[current:]:
        script = path.read_text()
        try:
            conn.executescript(f"BEGIN IMMEDIATE;\n{script}\nPRAGMA user_version = {number};\nCOMMIT;")
        except sqlite3.Error as exc:
            conn.rollback()
            raise MigrationError(f"migration {path.name} failed: {exc}") from exc
    return len(available)
