"""A real PostgreSQL for the tests: ``initdb`` and ``pg_ctl`` in a temporary directory.

PostgreSQL refuses to run as root, so as root the cluster belongs to an unprivileged user
(``nobody``, or ``LMSPD_TEST_PG_USER``) and runs under ``runuser``; otherwise it runs as the
current user. It listens on a unix socket in its directory and on a loopback port (the nodes of
tests/cluster connect by TCP). ``LMSPD_TEST_PG_URL`` points the tests at a server that already
runs instead (its databases are created and dropped as here).

One cluster per test session; each test gets a fresh database copied from a template that was
migrated once (``CREATE DATABASE ... TEMPLATE``), so a test pays no migration.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from harness.server import free_port

# Debian's layout first (the newest version), then PATH.
_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/opt/homebrew/opt/postgresql@*/bin", "/usr/local/opt/postgresql@*/bin")


def _version_key(path: str) -> tuple[int, ...]:
    digits = "".join(ch if ch.isdigit() else " " for ch in path).split()
    return tuple(int(d) for d in digits)


def bin_dir() -> Path | None:
    """Where ``initdb``, ``pg_ctl`` and ``postgres`` are (None: not installed)."""
    for pattern in _BIN_GLOBS:
        for found in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            if (Path(found) / "initdb").exists() and (Path(found) / "pg_ctl").exists():
                return Path(found)
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).resolve().parent
    return None


class PostgresServer:
    """A PostgreSQL cluster of the test session's own (or ``url``: one that already runs)."""

    def __init__(self, bindir: Path | None = None, url: str | None = None, *, durable: bool = False) -> None:
        self.bindir = bindir
        self.durable = durable  # fsync on, as a server runs (benchmarks); off for the tests
        self.external = url
        self.root: Path | None = None
        self.port = 0
        self.user = "lmspd"
        self._counter = itertools.count()

    # --- the cluster ------------------------------------------------------------------------

    def _as_owner(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        return ["runuser", "-u", os.environ.get("LMSPD_TEST_PG_USER", "nobody"), "--"]

    def start(self) -> None:
        if self.external is not None:
            return
        assert self.bindir is not None
        self.root = Path(tempfile.mkdtemp(prefix="lmspd-pg-"))
        if os.geteuid() == 0:
            owner = pwd.getpwnam(os.environ.get("LMSPD_TEST_PG_USER", "nobody"))
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
        data = self.root / "data"
        self.port = free_port()
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "check": True, "timeout": 120}
        subprocess.run(
            [
                *self._as_owner(),
                str(self.bindir / "initdb"),
                "-D",
                str(data),
                "-U",
                self.user,
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
            **quiet,  # type: ignore[call-overload]
        )
        self._pg_ctl_start()

    def _pg_ctl_start(self) -> None:
        assert self.bindir is not None and self.root is not None
        # fsync off: the tests prove what the store commits and reads, not the disk's durability
        # (synchronous_commit stays on, as in production); a small cluster starts fast.
        options = (
            f"-c port={self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
            "-c max_connections=200 -c shared_buffers=64MB"
        )
        if not self.durable:
            options += " -c fsync=off -c full_page_writes=off"
        data, log = str(self.root / "data"), str(self.root / "log")
        subprocess.run(
            [
                *self._as_owner(),
                str(self.bindir / "pg_ctl"),
                "-D",
                data,
                "-l",
                log,
                "-o",
                options,
                "-w",
                "-t",
                "60",
                "start",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            check=True,
            timeout=120,
        )

    def _pg_ctl_stop(self, *, check: bool) -> None:
        assert self.bindir is not None and self.root is not None
        data = str(self.root / "data")
        subprocess.run(
            [*self._as_owner(), str(self.bindir / "pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE if check else subprocess.DEVNULL,
            timeout=60,
            check=check,
        )

    def pause(self) -> None:
        """The server stopped at once (as a crash or a pulled cable would), its data kept:
        :meth:`resume` starts it again on the same port."""
        assert self.external is None
        self._pg_ctl_stop(check=True)

    def resume(self) -> None:
        assert self.external is None
        self._pg_ctl_start()

    def stop(self) -> None:
        if self.external is not None or self.root is None:
            return
        with contextlib.suppress(subprocess.SubprocessError):
            self._pg_ctl_stop(check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    # --- databases --------------------------------------------------------------------------

    def url(self, database: str = "postgres") -> str:
        if self.external is not None:
            base, _, _ = self.external.rpartition("/")
            return f"{base}/{database}"
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql)

    def create_database(self, template: str | None = None) -> str:
        """A new, empty (or ``template``'s copy) database; returns its URL."""
        name = f"lmspd_test_{os.getpid()}_{next(self._counter)}"
        self.admin(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rpartition("/")[2]
        with contextlib.suppress(Exception):
            self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def from_environment() -> PostgresServer | None:
    """The session's PostgreSQL, or None when none can be had (no binaries, no URL)."""
    if url := os.environ.get("LMSPD_TEST_PG_URL"):
        return PostgresServer(url=url)
    bindir = bin_dir()
    return PostgresServer(bindir) if bindir is not None else None


@contextlib.contextmanager
def durable_cluster(url: str | None, missing: str) -> Iterator[PostgresServer | None]:
    """A benchmark's or a reliability run's PostgreSQL: with ``url`` (one that already runs)
    None, the caller uses that; without, a cluster of its own, fsync on as a server runs,
    started here and stopped on exit. ``missing``: the message a run exits with where
    PostgreSQL is not installed."""
    if url is not None:
        yield None
        return
    found = bin_dir()
    if found is None:
        raise SystemExit(missing)
    server = PostgresServer(found, durable=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()
