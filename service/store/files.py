"""The data directory's files are the owner's alone: every directory lmspd makes there is 0700 and
every file 0600, whatever the process's umask (outside systemd, commonly 022: the database, its
WAL and the prompt caches hold every tenant's prompts and answers). docs/operations.md, "Files
and permissions". Files and directories that exist already keep their mode: that may be an
operator's choice (a group that reads backups), so only what lmspd creates is made private.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_dir(path: Path) -> Path:
    """``path`` as a directory: each missing part of it made 0700, from its first existing
    ancestor down (``mkdir``'s mode is cut by the umask, hence the chmod)."""
    missing: list[Path] = []
    for part in (path, *path.parents):
        if part.is_dir():
            break
        missing.append(part)
    for part in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it first: its mode stays
            part.mkdir(PRIVATE_DIR)
            os.chmod(part, PRIVATE_DIR)
    return path


def private_file(path: Path) -> None:
    """Create ``path`` empty and 0600 unless it exists. (For the SQLite database: SQLite gives
    the ``-wal`` and ``-shm`` files it makes beside it the database's own mode.)"""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, PRIVATE_FILE)  # os.open's mode is cut by the umask too
    finally:
        os.close(fd)
