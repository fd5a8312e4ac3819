"""``lmspd serve``'s runner: the port is bound before the lifespan starts the engine, and a
long startup (the kernels compiled on a first start) is not cut short."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.utils import LifespanTimeoutError
from starlette.applications import Starlette

from harness.server import free_port
from lmspd.cli import serve
from lmspd.config import Config, ServerConfig

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


async def serve_once(hc: Any) -> None:
    """Hypercorn serving ``hc`` an app whose startup takes a second (as a first start that
    compiles the kernels takes a minute), shut down as soon as the startup is done."""
    started = asyncio.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await asyncio.sleep(1.0)
        started.set()
        yield

    hc.bind = [f"127.0.0.1:{free_port()}"]
    await hypercorn_serve(Starlette(lifespan=lifespan), hc, shutdown_trigger=started.wait)  # type: ignore[arg-type]
    assert started.is_set()


async def test_a_startup_longer_than_hypercorns_bound_is_not_cut_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hypercorn's own default (60 s) failed a first start that compiled the kernels: the bound
    ``lmspd serve`` gives it is hours. Here Hypercorn's default is 0.2 s and the startup 1 s."""
    monkeypatch.setattr(HypercornConfig, "startup_timeout", 0.2)
    # The default cuts it: the bound is the one Hypercorn reads. On a loop of its own, which
    # asyncio.run closes with the lifespan Hypercorn abandons (it would linger on the session's).
    with pytest.raises(LifespanTimeoutError):
        await asyncio.to_thread(asyncio.run, serve_once(HypercornConfig()))
    hc = serve.hypercorn_config(Config(server=ServerConfig(host="127.0.0.1", port=free_port())))
    assert hc.startup_timeout == serve.STARTUP_TIMEOUT_SECS
    await serve_once(hc)
