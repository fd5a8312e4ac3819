"""``lmspd serve``: the app on Hypercorn, with SIGTERM/SIGINT as a clean shutdown."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from service.api.app import create_app
from service.config import Config
from service.errors import ConfigError

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
    hc.accesslog = None  # the app logs each request (service.api.access_log)
    # Hypercorn's own lines go through the root handler, in the server's --log-format (given a
    # target name, Hypercorn would add a handler of its own with its own format).
    errors = logging.getLogger("hypercorn.error")
    errors.setLevel(logging.INFO)
    hc.errorlog = errors
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # the app's lifespan owns what shutdown means
    await hypercorn_serve(app, hc, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
