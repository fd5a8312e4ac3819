"""``lmspd serve``: the app on Hypercorn, with SIGTERM/SIGINT as a clean shutdown."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import signal
import socket
from typing import Any

from .config import Config
from .errors import ConfigError
from .systemd import notify, notify_address, notify_when_ready

log = logging.getLogger("lmspd.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(config: Config) -> None:
    s = config.server
    if not s.tokens and not is_loopback(s.host) and not s.allow_unauthenticated_remote:
        raise ConfigError(
            f"refusing to listen on {s.host} without API tokens: configure server.tokens or LMSP_API_KEYS, "
            "or set server.allow_unauthenticated_remote = true",
            param="server.host",
        )


async def run(config: Config) -> None:
    # Imported here: check_bind's other callers (lmspd doctor) need neither the app nor Hypercorn.
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig

    from .api.app import create_app

    check_bind(config)
    stop = asyncio.Event()
    app = create_app(config, shutdown=stop)
    hc = HypercornConfig()
    hc.bind = [
        f"[{config.server.host}]:{config.server.port}"
        if ":" in config.server.host
        else f"{config.server.host}:{config.server.port}"
    ]
    hc.graceful_timeout = config.server.shutdown_grace_secs
    _drop_stalled_readers(hc, 2 * config.server.keepalive_secs)
    hc.accesslog = None  # the app logs each request (service.api.access_log)
    # Hypercorn's own lines go through the root handler, in the server's --log-format (given a
    # target name, Hypercorn would add a handler of its own with its own format).
    errors = logging.getLogger("hypercorn.error")
    errors.setLevel(logging.INFO)
    hc.errorlog = errors
    loop = asyncio.get_running_loop()
    # Under systemd (Type=notify): READY=1 once the server answers /readyz as a client would see it,
    # STOPPING=1 on SIGTERM. Without $NOTIFY_SOCKET neither probe nor message.
    ready: asyncio.Task[None] | None = None
    if notify_address():
        probe = notify_when_ready(config.server.host, config.server.port, f"serving on {hc.bind[0]}")
        ready = asyncio.create_task(probe)

    def on_signal() -> None:
        if not stop.is_set():
            if ready is not None:
                ready.cancel()  # a server stopped before it was ready never says READY=1
            notify("STOPPING=1")
        stop.set()  # the app's lifespan owns what shutdown means

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await hypercorn_serve(app, hc, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    finally:
        if ready is not None:
            ready.cancel()


def _drop_stalled_readers(hc: Any, secs: float) -> None:
    """Have the kernel close a connection whose reader has taken nothing for ``secs`` (Linux's
    TCP_USER_TIMEOUT, inherited by accepted sockets): the app stops serving such a reader
    (service.api.events), and this frees its socket too, even while the peer holds it open."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is None:  # not on macOS: there the peer's close frees it
        return
    logging.getLogger("asyncio").addFilter(_dropped_by_the_kernel)
    create = hc.create_sockets

    def create_sockets() -> Any:
        sockets = create()
        for sock in sockets.insecure_sockets:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, option, int(secs * 1000))
        return sockets

    hc.create_sockets = create_sockets


def _dropped_by_the_kernel(record: logging.LogRecord) -> bool:
    """Hypercorn does not expect the ETIMEDOUT of a connection the kernel dropped (what
    TCP_USER_TIMEOUT is set for), and asyncio would log a traceback for each: a flood of them
    under abuse. The access log has the stream's line already."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (
        isinstance(exc, TimeoutError)
        and exc.errno == errno.ETIMEDOUT
        and record.getMessage().startswith("Unhandled exception in client_connected_cb")
    )
