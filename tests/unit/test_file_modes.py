"""The data directory is the owner's alone (docs/operations.md, "Files and permissions"): under the
common umask 022 (outside systemd), a new database, its WAL and SHM files are 0600 and the
directories lmspd makes for them 0700; so is the reasoning key's directory. (The prompt cache's
files: tests/engine/test_prompt_cache.py.)"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmspd.responses.sealing import KEY_FILE, Sealer
from lmspd.store.db import Database
from lmspd.store.files import private_dir, private_file


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The umask of a login shell, whatever the test runner's."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_new_database_and_its_wal_and_shm_are_the_owners_alone(umask_022: None, tmp_path: Path) -> None:
    data = tmp_path / "share" / "lmspd"  # neither exists yet
    path = data / "lmspd.db"

    async def run() -> dict[str, int]:
        db = await Database.open(path)
        try:
            await db.writer.submit(lambda conn: conn.run("count_active"))  # a write: the WAL and SHM exist
            return {p.name: mode(p) for p in data.iterdir()}
        finally:
            await db.close()

    modes = asyncio.run(run())
    assert modes == {"lmspd.db": 0o600, "lmspd.db-wal": 0o600, "lmspd.db-shm": 0o600}, {
        k: oct(v) for k, v in modes.items()
    }
    assert mode(data) == 0o700 and mode(data.parent) == 0o700  # every directory it made


def test_the_reasoning_keys_directory_is_the_owners_alone(umask_022: None, tmp_path: Path) -> None:
    Sealer.at(tmp_path / "data")
    assert mode(tmp_path / "data") == 0o700 and mode(tmp_path / "data" / KEY_FILE) == 0o600


def test_what_exists_keeps_its_mode(umask_022: None, tmp_path: Path) -> None:
    """An operator's choice (a group that reads backups) stands: only what lmspd creates is private."""
    (tmp_path / "shared").mkdir(mode=0o750)
    (tmp_path / "shared" / "lmspd.db").touch(mode=0o640)
    private_dir(tmp_path / "shared")
    private_file(tmp_path / "shared" / "lmspd.db")
    assert mode(tmp_path / "shared") == 0o750 and mode(tmp_path / "shared" / "lmspd.db") == 0o640
