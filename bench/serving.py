"""Starting and stopping a real server process for the benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(
    cmd: list[str], ready_url: str, log: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group (so a kill takes its children too), logging to
    ``log``, and wait until ``ready_url`` answers 200."""
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(ready_url, timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    kill(proc, signal.SIGKILL)
    raise RuntimeError(f"{cmd[0]} did not become ready at {ready_url}")


def serve(
    work: Path, config: str, timeout: float = 120, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``lmspd serve`` on ``config`` (TOML text, written to ``work``), ready on a free port:
    the process and its base URL. Its log is ``work/server.log``; ``env``: its environment,
    if not this process's."""
    path = work / "lmspd.toml"
    path.write_text(config)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(path), "--port", str(port)]
    return spawn(cmd, f"{url}/readyz", work / "server.log", timeout=timeout, env=env), url


def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Signal the process group; SIGKILL it if it has not exited within ``timeout``."""
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
