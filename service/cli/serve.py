"""``lmspd serve``: the app on Hypercorn, with SIGTERM/SIGINT as a clean shutdown."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from typing import Any

from lmspd.api.guard import is_loopback
from lmspd.cli.systemd import notify, notify_address, notify_when_ready
from lmspd.config import Config
from lmspd.errors import ConfigError, LmspdError

STARTUP_TIMEOUT_SECS = 6 * 3600.0  # Hypercorn's bound on the lifespan's startup: see serve()

log = logging.getLogger("lmspd.server")


class StartupError(LmspdError):
    """``lmspd serve`` could not start; the message says why and what to do, in one line."""

    code = "startup_failed"
    title = "Startup failed"


def startup_error(config: Config, cause: BaseException | None) -> StartupError:
    from lmspd.store.check import DatabaseUnusableError

    if isinstance(cause, DatabaseUnusableError):
        return StartupError(cause.message)  # it names the file, the cause and `lmspd doctor`
    from lmspd.store.url import StoreUrl

    what = cause.message if isinstance(cause, LmspdError) else f"{type(cause).__name__}: {cause}"
    try:
        where = str(StoreUrl.parse(config.store.url, config.server.database_path))  # its password hidden
    except LmspdError:
        where = str(config.server.database_path)
    return StartupError(f"{what} (database {where}); run `lmspd doctor` for details")


def check_port(config: Config) -> None:
    """Bind the address for a moment, before anything starts, as the server will (SO_REUSEADDR)."""
    host, port = config.server.host, config.server.port
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        raise cannot_listen(config, exc) from exc


def cannot_listen(config: Config, exc: OSError) -> StartupError:
    host, port = config.server.host, config.server.port
    return StartupError(
        f"cannot listen on {host}:{port}: {exc.strerror or exc}; run `lmspd doctor` for details", param="port"
    )


def check_bind(config: Config) -> None:
    s = config.server
    if not (s.tokens or s.admin_tokens) and not is_loopback(s.host) and not s.allow_unauthenticated_remote:
        raise ConfigError(
            f"refusing to listen on {s.host} without API tokens: configure server.tokens or LMSP_API_KEYS, "
            "or set server.allow_unauthenticated_remote = true",
            param="server.host",
        )


async def run(config: Config) -> None:
    # Imported here: check_bind's other callers (lmspd doctor) need neither the app nor Hypercorn.
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.utils import LifespanFailureError

    from lmspd.api.app import create_app

    check_bind(config)
    stop = asyncio.Event()
    app = create_app(config, shutdown=stop)
    hc = hypercorn_config(config)
    sockets = _bind_now(hc, config)
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
    except LifespanFailureError as exc:
        cause = getattr(app.state, "startup_error", None)
        raise startup_error(config, cause) from cause or exc
    finally:
        if ready is not None:
            ready.cancel()
        for sock in sockets.insecure_sockets:
            sock.close()


def hypercorn_config(config: Config) -> Any:
    """Hypercorn's Config for ``lmspd serve``: the bind, the grace, the bounds and the logs."""
    from hypercorn.config import Config as HypercornConfig

    hc = HypercornConfig()
    hc.bind = [
        f"[{config.server.host}]:{config.server.port}"
        if ":" in config.server.host
        else f"{config.server.host}:{config.server.port}"
    ]
    hc.graceful_timeout = config.server.shutdown_grace_secs
    # The lifespan's startup recovers unfinished tasks and preloads models, which on a fresh
    # machine includes compiling lmspd's kernels (about a minute on two cores, docs/engine.md)
    # and on a real model reading gigabytes: Hypercorn's 60 s default failed such a start. Its
    # own steps are bounded (engine start, loads); this only must not cut them short.
    hc.startup_timeout = STARTUP_TIMEOUT_SECS
    _drop_stalled_readers(hc, 2 * config.server.keepalive_secs)
    hc.accesslog = None  # the app logs each request (lmspd.api.access_log)
    # Hypercorn's own lines go through the root handler, in the server's --log-format (given a
    # target name, Hypercorn would add a handler of its own with its own format).
    errors = logging.getLogger("hypercorn.error")
    errors.setLevel(logging.INFO)
    hc.errorlog = errors
    return hc


def _bind_now(hc: Any, config: Config) -> Any:
    """Bind the listening sockets before the lifespan starts the engine (Hypercorn would bind
    after it, seconds later): the port is this server's from the start, so a port another
    process takes meanwhile cannot fail a server that has already loaded its model. Nothing
    listens on them until the app is up."""
    try:
        sockets = hc.create_sockets()
    except OSError as exc:
        raise cannot_listen(config, exc) from exc
    hc.create_sockets = lambda: sockets
    return sockets


def _drop_stalled_readers(hc: Any, secs: float) -> None:
    """Have the kernel close a connection whose reader has taken nothing for ``secs`` (Linux's
    TCP_USER_TIMEOUT, inherited by accepted sockets): the app stops serving such a reader
    (lmspd.api.events), and this frees its socket too, even while the peer holds it open."""
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
