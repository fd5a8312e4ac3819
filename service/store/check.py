"""The database checked before lmspd uses it: read-only, so a refusal never changes the file.

A server that opens a damaged file finds out request by request, as 500s, or hangs in its
start-up; this finds out first, in one pass: the header says SQLite, ``PRAGMA quick_check``
passes (it reads every page, so damage in the second half of the file counts too), the
schema version is one this lmspd knows, and every table, column and index the migrations
made up to that version is there.
"""

from __future__ import annotations

import os
import sqlite3
from importlib.resources.abc import Traversable
from pathlib import Path

from lmspd.errors import LmspdError
from lmspd.store.migrate import migrations

HEADER = b"SQLite format 3\x00"
_SCHEMA = (
    "SELECT type, name FROM sqlite_master WHERE type IN ('table', 'index', 'trigger') AND name NOT LIKE 'sqlite_%'"
)


class DatabaseUnusableError(LmspdError):
    """The database file cannot be used as it is; nothing was written to it."""

    code = "database_unusable"
    title = "Database unusable"


Schema = dict[tuple[str, str], frozenset[str]]  # (type, name) -> columns (empty for an index or trigger)


def _schema(conn: sqlite3.Connection) -> Schema:
    found: Schema = {}
    for kind, name in conn.execute(_SCHEMA).fetchall():
        columns = conn.execute(f'PRAGMA table_info("{name}")').fetchall() if kind == "table" else []
        found[(kind, name)] = frozenset(str(row[1]) for row in columns)
    return found


def expected_schema(version: int, directory: Traversable | None = None) -> Schema:
    """What the migrations up to ``version`` create, applied to an empty in-memory database."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        for _, path in migrations(directory)[:version]:
            conn.executescript(path.read_text())
        return _schema(conn)
    finally:
        conn.close()


def problem(path: Path, directory: Traversable | None = None) -> str | None:
    """What is wrong with the database at ``path`` (None: nothing, or it does not exist yet).
    Opened read-only: neither this check nor a refusal changes the file."""
    try:
        with path.open("rb") as f:
            head = f.read(100)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    if not head:
        return None  # an empty file is an empty database: lmspd creates its tables in it
    if not head.startswith(HEADER):
        return "it is not an SQLite database (its header is not SQLite's)"
    if len(head) < 100:
        return f"it is truncated ({len(head)} bytes, shorter than SQLite's header)"
    latest = len(migrations(directory))
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5, isolation_level=None)
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > latest:
                return f"its schema version is {version}, newer than this lmspd's ({latest}): upgrade lmspd"
            damage = [line for row in conn.execute("PRAGMA quick_check(3)") for line in str(row[0]).splitlines()]
            if damage != ["ok"]:  # one line, as a log line must be
                return "it is damaged: " + "; ".join(line.strip("* ") for line in damage[:4])
            found = _schema(conn)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        # Reading a WAL database needs its -shm and -wal files: on a full or read-only disk
        # SQLite says "disk I/O error" or "unable to open", which is no damage of the file.
        return disk_problem(path) or f"it is damaged: {exc}"
    missing: list[str] = []
    for (kind, name), columns in expected_schema(version, directory).items():
        if (kind, name) not in found:
            missing.append(f"{kind} {name}")
        elif lost := sorted(columns - found[(kind, name)]):
            missing.append(f"table {name} columns {', '.join(lost)}")
    if missing:
        return f"its schema (version {version}) lacks " + "; ".join(missing)
    # What the pending migrations would create must not be there yet: another program's file.
    pending = set(expected_schema(latest, directory)) - set(expected_schema(version, directory))
    if clash := sorted(f"{kind} {name}" for kind, name in pending & set(found)):
        return f"at schema version {version} it already has {', '.join(clash)}: it is not an lmspd database"
    return None


# Less free than this on the database's disk, and a failure to open it is the disk's.
FULL_BELOW_BYTES = 1024**2


def disk_problem(path: Path) -> str | None:
    """A full or read-only disk (or directory) where the database lives, said as such:
    what a failure to open or write it then means (None: the disk looks fine)."""
    folder = path.parent
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return f"the disk holding it ({folder}) is read-only: lmspd writes its database there"
    if (free := st.f_bavail * st.f_frsize) < FULL_BELOW_BYTES:
        return f"the disk holding it ({folder}) is full ({free} bytes free): free some space"
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return f"it is read-only to this user ({path}): lmspd writes its database and the files beside it"
    return None


def check(path: Path, directory: Traversable | None = None) -> None:
    """Raise :class:`DatabaseUnusableError` naming the file, the cause and what to do."""
    if (cause := problem(path, directory)) is not None:
        raise DatabaseUnusableError(refusal(path, cause))


def refusal(path: Path, cause: str) -> str:
    return f"the database {path} cannot be used: {cause}. It was left as it is; run `lmspd doctor` for details"
