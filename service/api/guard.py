"""Who may call at all, before any route runs: the checks that keep a web page in the user's
own browser from driving a local lmspd (docs/operations.md, "Security").

A browser tab is a local caller too. Three rules close what it could do, and leave SDKs,
agents, the CLI and curl (which send no ``Origin``) as they were:

- **Host.** A page that rebinds a name of its own to 127.0.0.1 reads the answers
  same-origin, but its requests carry its name in ``Host``. Only loopback names and
  addresses, ``[server] allowed_hosts``, and (when the server listens beyond loopback) IP
  addresses are answered; a page cannot make an address its origin. Else 421.
- **Origin.** A page of another origin may send a request it cannot read (a form, a
  ``no-cors`` fetch); every browser marks it with ``Origin``. A state-changing method whose
  ``Origin`` is neither the server's own nor in ``[server] allowed_origins`` is refused
  (403), whatever token it carries; reads get no CORS grant, so the page cannot read them.
- **Content-Type.** A body must say it is JSON (415): the forms and ``text/plain`` bodies a
  page may send without asking are not JSON, so this holds even where ``Origin`` is missing.

A pure ASGI middleware (like :mod:`lmspd.api.access_log`): streamed answers pass untouched.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from lmspd.api.problems import error_response
from lmspd.errors import ForbiddenOriginError, LmspdError, MisdirectedRequestError, UnsupportedMediaTypeError

# Methods a page may not use from another origin: everything that is not a read. OPTIONS is
# among them, so a foreign page's preflight is refused as plainly as its request would be.
_READS = frozenset({"GET", "HEAD"})
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def is_json(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type, parameters aside (RFC 6839)."""
    kind = content_type.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def split_authority(authority: str) -> tuple[str, int | None] | None:
    """A ``Host`` value's name (lower case, no trailing dot; an IPv6 address without its
    brackets) and port; None for a value that is not ``host[:port]``."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        name, bracket, rest = authority[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:]
    else:
        name, _, port_text = authority.partition(":")
    if port_text and not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5):
        return None
    name = name.rstrip(".")
    return (name, int(port_text) if port_text else None) if name else None


def is_loopback(host: str) -> bool:
    """Whether a name or address (a bind address, or a ``Host``'s name) is this machine's
    loopback: ``localhost`` and its subdomains (RFC 6761), 127.0.0.0/8, ``::1``."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class HostPolicy:
    """The ``Host`` names this server answers to (the module's first rule)."""

    def __init__(self, allowed: Iterable[str], *, listens_beyond_loopback: bool) -> None:
        entries = [entry.strip().lower().rstrip(".") for entry in allowed]
        self._any = "*" in entries
        self._names = frozenset(e.strip("[]") for e in entries if not e.startswith("."))
        self._suffixes = tuple(e for e in entries if e.startswith("."))
        self._addresses = listens_beyond_loopback

    def allows(self, name: str) -> bool:
        if self._any or is_loopback(name) or name in self._names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return name.endswith(self._suffixes)
        return self._addresses


class RequestGuard:
    """The middleware: Host, then Origin, then Content-Type; a refusal is rendered as the
    route's errors are (:func:`lmspd.api.problems.error_response`)."""

    def __init__(self, app: ASGIApp, *, hosts: HostPolicy, origins: Iterable[str] = ()) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = frozenset(o.lower() for o in origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refusal := self.refusal(scope)) is not None:
            await error_response(scope["path"], refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> LmspdError | None:
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, value)  # the first of a repeated header, as Starlette reads it
        host = headers.get(b"host")
        authority = split_authority(host.decode("latin-1")) if host is not None else None
        if host is not None and (authority is None or not self.hosts.allows(authority[0])):
            return MisdirectedRequestError(
                f"this server does not answer to Host {host.decode('latin-1')!r}: "
                "add it to server.allowed_hosts to reach it by that name",
                param="Host",
            )
        method = scope["method"]
        if method in _READS:
            return None
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin.decode("latin-1"), scope, authority):
            return ForbiddenOriginError(
                f"a page of origin {origin.decode('latin-1')!r} may not call {method} here: "
                "add it to server.allowed_origins to let it",
                param="Origin",
            )
        declared = headers.get(b"content-type")
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if (declared is not None or has_body) and not is_json((declared or b"").decode("latin-1")):
            shown = repr(declared.decode("latin-1")) if declared is not None else "none"
            return UnsupportedMediaTypeError(
                f"Content-Type {shown} is not supported: send application/json", param="Content-Type"
            )
        return None

    def _origin_allowed(self, origin: str, scope: Scope, authority: tuple[str, int | None] | None) -> bool:
        origin = origin.strip().lower()
        if "*" in self.origins or origin in self.origins:
            return True
        if authority is None:  # no Host to be the same origin as
            return False
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or parts.path or not parts.hostname:
            return False  # "null" (a sandboxed or privacy-stripped page) is nobody's own origin
        try:
            origin_port = parts.port or _DEFAULT_PORTS[parts.scheme]
        except ValueError:
            return False
        name, port = authority
        return parts.hostname.rstrip(".") == name and origin_port == (port or _DEFAULT_PORTS.get(scope["scheme"], 80))
