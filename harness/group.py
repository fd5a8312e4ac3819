"""An engine group on this machine for the tests (docs/distributed.md): free loopback ports for
its ranks, and ``lmspd engine join`` run as the other host would run it (a subprocess, its
own rank processes under it, its log kept)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from harness.wait import wait_until


def free_port_pairs(n: int) -> list[int]:
    """``n`` loopback ports P each free now with P + 1 (a rank's ring port and, on rank 0, its
    control channel's), all different (held together while chosen, then released)."""
    with contextlib.ExitStack() as stack:
        found: list[int] = []
        while len(found) < n:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            second = stack.enter_context(socket.socket())
            with contextlib.suppress(OSError):
                second.bind(("127.0.0.1", port + 1))
                found.append(port)
        return found


def loopback_hosts(n: int = 2) -> list[str]:
    return [f"127.0.0.1:{port}" for port in free_port_pairs(n)]


def toml_list(values: list[str]) -> str:
    return "[" + ", ".join(f'"{v}"' for v in values) + "]"


class Joiner:
    """``lmspd engine join --rank N`` with a config naming ``hosts``: its rank processes come
    and go as groups form and break; ``rank_pid`` is the one now."""

    def __init__(
        self,
        workdir: Path,
        hosts: list[str],
        *,
        rank: int = 1,
        timeout_secs: float = 10.0,
        cache_dir: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.config = workdir / f"join-{rank}.toml"
        lines = ["[engine]", f"hosts = {toml_list(hosts)}", f"group_timeout_secs = {timeout_secs}"]
        if kernel_dir := os.environ.get("LMSPD_KERNEL_DIR"):
            lines.append(f'kernel_dir = "{kernel_dir}"')
        if cache_dir is not None:
            lines.insert(0, f'cache_dir = "{cache_dir}"')
        self.config.write_text("\n".join(lines) + "\n")
        self.log_path = workdir / f"join-{rank}.log"
        self.rank = rank
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Joiner:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "lmspd.cli",
                    "-v",
                    "engine",
                    "join",
                    "--rank",
                    str(self.rank),
                    "--config",
                    str(self.config),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rank_pids(self) -> list[int]:
        """Its rank processes (multiprocessing's spawned children; not its resource tracker)."""
        assert self.process is not None
        pid = self.process.pid
        ranks = []
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
                with contextlib.suppress(OSError):
                    if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                        ranks.append(int(child))
        return ranks

    def rank_pid(self, timeout: float = 30.0) -> int:
        """The rank process now running (waiting for one to be)."""
        wait_until(lambda: bool(self.rank_pids()), "the join's rank process started", timeout=timeout)
        return self.rank_pids()[0]

    def joined(self, times: int = 1, timeout: float = 60.0) -> None:
        """Wait until its ranks have joined a group ``times`` times in all."""
        wait_until(
            lambda: self.log.count("joined the engine group") >= times,
            f"rank {self.rank} joined {times} time(s)",
            timeout=timeout,
        )

    def kill_rank(self) -> int:
        pid = self.rank_pid()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: pid not in self.rank_pids(), "the killed rank reaped", timeout=10)
        return pid
