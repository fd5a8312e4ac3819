"""Apply numbered ``migrations/NNN_name.sql`` files, tracked by ``PRAGMA user_version``."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from service.errors import LmspdError

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent.parent / "migrations"
_FILE = re.compile(r"^(\d+)_[\w-]+\.sql$")


class MigrationError(LmspdError):
    code = "migration_failed"


def migrations(directory: Path = MIGRATIONS_DIR) -> list[tuple[int, Path]]:
    found = sorted((int(m.group(1)), p) for p in directory.glob("*.sql") if (m := _FILE.match(p.name)))
    numbers = [n for n, _ in found]
    if numbers != list(range(1, len(numbers) + 1)):
        raise MigrationError(f"migrations in {directory} must be numbered 1..N without gaps, found {numbers}")
    return found


def migrate(conn: sqlite3.Connection, directory: Path = MIGRATIONS_DIR) -> int:
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
