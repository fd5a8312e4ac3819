"""``lmspd serve``'s runner: the port is bound before the lifespan starts the engine."""

from __future__ import annotations

import errno
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.server import free_port

# serve.run with an app whose startup waits (as for an engine) until a file appears.
SCRIPT = """
import asyncio, contextlib, sys
from pathlib import Path
from starlette.applications import Starlette
import lmspd.api.app
from lmspd.cli import serve
from lmspd.config import Config, ServerConfig

release = Path(sys.argv[2])

def blocked_app(config, shutdown=None):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        print("starting", flush=True)
        while not release.exists():
            await asyncio.sleep(0.01)
        yield
    return Starlette(lifespan=lifespan)

lmspd.api.app.create_app = blocked_app
config = Config(server=ServerConfig(host="127.0.0.1", port=int(sys.argv[1]), data_dir=sys.argv[3]))
asyncio.run(serve.run(config))
"""


def bind_fails(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
        return False


def test_the_port_is_held_while_the_app_starts(tmp_path: Path) -> None:
    port, release = free_port(), tmp_path / "release"
    args = [sys.executable, "-c", SCRIPT, str(port), str(release), str(tmp_path)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "starting"
        # The app is starting (an engine would take seconds here) and will until released.
        assert bind_fails(port), "the port is free while the app starts: another process could take it"
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", port))  # bound, but nothing is served before the app is up
    finally:
        release.touch()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
