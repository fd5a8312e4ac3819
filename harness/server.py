"""A real ``lmspd serve`` process on a tiny model, and the HTTP calls the tests make to it.

``tiny_server`` writes the config of one server; a module that needs a server of its own
(a config no other module uses, or one it kills and restarts) starts it from here. ``spawn``,
``serve`` and ``kill`` start and stop any command in its own process group, as the benchmarks
and the reliability runs do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec

from harness.wait import wait_until
from lmspd.models.registry import ResolvedModel

FINAL_STATUSES = ("succeeded", "failed", "cancelled")


def free_port() -> int:
    """A loopback port nothing listens on now (the one definition: servers, PostgreSQL, tests)."""
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


class Server:
    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.config, self.port, self.log = config, port, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        """Start the process and wait until it is ready (``/readyz``)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(self.config), "--port", str(self.port)],
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        wait_until(self.ready, "the server to become ready", timeout=120, interval=0.1)

    def ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@contextlib.contextmanager
def tiny_server(
    tmp: Path,
    model_cache: Path,
    tiny: ResolvedModel,
    *,
    engine: str = "",
    server: str = "",
    models: str = "",
    responses: str = "",
    dtype: str = "quantized",
) -> Iterator[Server]:
    """A configured (not yet started) ``lmspd serve`` on the tiny model, killed on exit.
    ``engine``, ``server``, ``models`` and ``responses`` are extra TOML lines for those
    sections; ``dtype`` the engine's weight dtype (float32 where the bundled model must
    prefill fast)."""
    config = tmp / "lmspd.toml"
    config.write_text(
        f'default_model = "tiny"\ncache_dir = "{model_cache}"\n'
        f'[engine]\nweight_dtype = "{dtype}"\n{engine}'
        f'[server]\ndata_dir = "{tmp / "data"}"\n{server}'
        f'[models.tiny]\npath = "{tiny.path}"\n{models}'
        f"[responses]\n{responses}"
    )
    srv = Server(config, free_port(), tmp / "server.log")
    try:
        yield srv
    finally:
        if srv.proc and srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(10)


def submit(url: str, on_restart: str, text: str, max_tokens: int) -> dict[str, Any]:
    """A greedy response task on ``text``, accepted (202)."""
    body = {
        "type": "response",
        "on_restart": on_restart,
        "input": {"input": text, "temperature": 0, "max_output_tokens": max_tokens},
    }
    r = httpx.post(f"{url}/lmsp/v1/tasks", json=body, timeout=30)
    assert r.status_code == 202, r.text
    return dict(r.json())


def read_sse(
    url: str, task_id: str, out: list[dict[str, Any]], last_event_id: int | None = None, stop_after: int | None = None
) -> None:
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
    try:
        with httpx.stream("GET", f"{url}/lmsp/v1/tasks/{task_id}/events", headers=headers, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(msgspec.json.decode(line[6:]))
                    if stop_after is not None and len(out) >= stop_after:
                        return
    except httpx.HTTPError:
        pass  # the server was killed under us


def task(url: str, task_id: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/lmsp/v1/tasks/{task_id}", timeout=10).json())


def wait_final(url: str, task_id: str, timeout: float = 120) -> dict[str, Any]:
    """The task once it is finished (succeeded, failed or cancelled)."""

    def final() -> dict[str, Any] | None:
        found = task(url, task_id)
        return found if found["status"] in FINAL_STATUSES else None

    return wait_until(final, lambda: f"{task_id} to finish: {task(url, task_id)}", timeout=timeout, interval=0.1)
