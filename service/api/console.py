"""The web console (docs/console.md): ``GET /`` and its assets under ``/console/``, served from
package data (``lmspd/api/static``, in the wheel), never from a CDN.

The page holds no data, so these routes need no token; everything it shows it reads from the API
with the bearer token the person typed (kept in ``sessionStorage``). Every answer carries a strict
Content-Security-Policy (scripts, styles and connections from this origin only, no inline code),
``X-Content-Type-Options: nosniff`` and a strong ETag; ``If-None-Match`` with it answers 304.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from lmspd.api.routing import Op, Operation, header

# No inline script or style, no other origin, no plugins, not framed, no <base> games.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
MEDIA = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # always revalidated: a new lmspd's page is seen at once (304 otherwise)
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    media: str
    etag: str


def _load() -> dict[str, Asset]:
    assets: dict[str, Asset] = {}
    for entry in resources.files(__package__).joinpath("static").iterdir():
        media = MEDIA.get("." + entry.name.rpartition(".")[2])
        if media is None or not entry.is_file():
            continue
        body = entry.read_bytes()
        assets[entry.name] = Asset(body, media, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    return assets


ASSETS = _load()


def _matches(if_none_match: str, etag: str) -> bool:
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in tags or etag in tags


def _serve(name: str) -> Operation:
    asset = ASSETS[name]

    async def endpoint(request: Request) -> Response:
        headers = HEADERS | {"ETag": asset.etag}
        if _matches(request.headers.get("if-none-match", ""), asset.etag):
            return Response(status_code=304, headers=headers)
        return Response(asset.body, media_type=asset.media, headers=headers)

    path = "/" if name == "index.html" else f"/console/{name}"
    return Operation(
        path,
        endpoint,
        Op(
            "The web console" if name == "index.html" else f"The console's {name}",
            "console",
            str,
            auth=False,
            media=asset.media.partition(";")[0],
            params=(header("If-None-Match", "an ETag from an earlier answer"),),
            headers={
                "ETag": "the asset's content hash",
                "Content-Security-Policy": "the console's policy: this origin only, no inline code",
                "X-Content-Type-Options": "nosniff",
            },
            other={304: ("not modified since the ETag sent", None)},
            description="Package data; no token (the page holds no data: it reads the API with the bearer).",
        ),
    )


ROUTES = [_serve(name) for name in sorted(ASSETS, key=lambda n: (n != "index.html", n))]
