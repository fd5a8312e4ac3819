"""``[store] url`` (env ``LMSPD_STORE_URL``): which database lmspd keeps its tasks in.

Unset or ``sqlite:///path`` (``sqlite:////abs/path``, or ``sqlite:///relative/path``): the
embedded SQLite file (the default, ``[server] data_dir``'s ``lmspd.db``). ``postgresql://…``
(or ``postgres://…``): a PostgreSQL ≥ 15 server, libpq's URL with its query options
(docs/operations.md, "Several nodes"). A URL is only ever shown with its password hidden.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import msgspec

from lmspd.errors import ConfigError


class StoreUrl(msgspec.Struct, frozen=True):
    dialect: str  # "sqlite" or "postgresql"
    url: str  # what libpq connects to (PostgreSQL); "" for SQLite
    path: Path | None = None  # the SQLite file

    @classmethod
    def parse(cls, url: str | None, default_path: Path) -> StoreUrl:
        if not url:
            return cls("sqlite", "", default_path)
        parts = urlsplit(url)
        if parts.scheme == "sqlite":
            # sqlite:///x is the relative path x, sqlite:////x the absolute /x (SQLAlchemy's reading).
            if parts.netloc or not parts.path.startswith("/") or len(parts.path) < 2:
                raise ConfigError(f"store.url {url!r}: write sqlite:///relative/path or sqlite:////absolute/path")
            return cls("sqlite", "", Path(parts.path[1:]).expanduser())
        if parts.scheme in ("postgresql", "postgres"):
            return cls("postgresql", url)
        raise ConfigError(f"store.url must be sqlite:///… or postgresql://…, got {redact(url)!r}", param="store.url")

    def __str__(self) -> str:
        return str(self.path) if self.dialect == "sqlite" else redact(self.url)


def redact(url: str) -> str:
    """``url`` with its password (in the netloc or a ``password=`` option) shown as ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        netloc = f"{userinfo}@{host}"
    query = "&".join(
        f"{k}=***" if k.lower() == "password" else f"{k}{sep}{v}"
        for k, sep, v in (item.partition("=") for item in parts.query.split("&") if item)
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
