"""A tiny ``sd_notify``: tells systemd (``Type=notify``) when the server is ready and stopping.

systemd passes ``$NOTIFY_SOCKET``, a unix datagram socket: a path, or an abstract-namespace
name written with a leading ``@``. Each message is one datagram of ``KEY=VALUE`` lines. Without
the variable (a terminal, launchd) every call is a no-op. No dependency beyond the stdlib.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import msgspec

log = logging.getLogger("lmspd.server")

# How often the readiness probe asks /readyz while the server is starting...
PROBE_INTERVAL_SECS = 0.05
# ...and once it answers but is not ready (the default model cannot load): it is up and has said
# why, and each probe is a line of the access log.
NOT_READY_INTERVAL_SECS = 5.0
PROBE_TIMEOUT_SECS = 5.0


def notify_address(environ: dict[str, str] | None = None) -> str | None:
    """The socket address from ``$NOTIFY_SOCKET``, ``@name`` mapped to the abstract namespace."""
    value = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # unset, or a kind this helper does not speak (vsock:)


def notify(state: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to the service manager; False when there is none or it
    cannot be reached (logged, never raised: a lost notification must not stop the server)."""
    address = notify_address(environ)
    if address is None or not hasattr(socket, "AF_UNIX"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify %r failed: %s", state.split("\n", 1)[0], exc)
        return False
    return True


def probe_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from the same machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


class _Health(msgspec.Struct):
    reason: str | None = None


async def readyz(host: str, port: int) -> tuple[bool, str | None]:
    """Whether ``GET /readyz`` on the server answers 200 (refused or 503 while starting), and the
    ``reason`` a 503 gives (None: no answer, or none given)."""
    try:
        reader, writer = await asyncio.open_connection(probe_host(host), port)
    except OSError:
        return False, None
    # The Host names the address dialled: one the server answers to (lmspd.api.guard).
    name = probe_host(host)
    authority = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
    try:
        writer.write(f"GET /readyz HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        answer = b""  # b"HTTP/1.1 503 \r\n...\r\n\r\n{...}", to the end (Connection: close)
        while len(answer) < 1 << 16 and (chunk := await reader.read(1 << 16)):
            answer += chunk
        if answer.split(b" ")[1:2] == [b"200"]:
            return True, None
        with contextlib.suppress(msgspec.DecodeError):
            return False, msgspec.json.decode(answer.partition(b"\r\n\r\n")[2], type=_Health).reason
        return False, None
    except OSError:
        return False, None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def notify_when_ready(host: str, port: int, status: str) -> None:
    """Send ``READY=1`` once the server itself answers ``/readyz`` 200: after the default model's
    preload, the lifespan's recovery of unfinished tasks, the engine start and the listener —
    readiness as any client sees it, not as a step of startup guesses it. A server that answers
    503 with a reason (its default model cannot load) is up but not ready: systemd hears
    ``STATUS=not ready: <reason>`` instead, and never READY=1 unless that changes
    (docs/operations.md, "Readiness")."""
    said: str | None = None
    while True:
        reason: str | None = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PROBE_TIMEOUT_SECS):
                ready, reason = await readyz(host, port)
                if ready:
                    break
        if reason is not None and reason != said:
            said = reason
            log.warning("not ready, READY=1 withheld: %s", reason, extra={"ready": False})
            notify(f"STATUS=not ready: {reason}")
        await asyncio.sleep(PROBE_INTERVAL_SECS if reason is None else NOT_READY_INTERVAL_SECS)
    notify(f"READY=1\nSTATUS={status}")
