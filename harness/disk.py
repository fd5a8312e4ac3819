"""A small file system of its own for a test: a tmpfs mounted on a directory, to fill up or
make read-only (a real ENOSPC or EROFS, as a full or read-only disk gives). Mounting needs
root (CAP_SYS_ADMIN); without it a test that asks for one is skipped."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _run(*cmd: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(cmd), capture_output=True, timeout=30, check=False)


@contextlib.contextmanager
def small_disk(path: Path, size: int) -> Iterator[Path]:
    """``path`` as a tmpfs of ``size`` bytes while the block runs (unmounted after)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small file system needs root to mount a tmpfs")
    mounted = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int = 0, name: str = "filler") -> Path:
    """Take the file system's free space but ``leave`` bytes with one file (removed to free it)."""
    filler = path / name
    with filler.open("ab") as f:
        chunk = b"\0" * (1 << 16)
        while (room := free(path) - leave) > 0:
            try:
                f.write(chunk[: min(len(chunk), room)])
                f.flush()
            except OSError:  # full: this is as far as it goes
                break
    return filler


def read_only(path: Path, on: bool = True) -> None:
    """Remount the file system at ``path`` read-only (or writable again)."""
    done = _run("mount", "-o", f"remount,{'ro' if on else 'rw'}", str(path))
    assert done.returncode == 0, done.stderr.decode()
