"""Load the named queries, one file per database (procrastinate's style: SQL lives in .sql files):
``queries.sql`` for SQLite, ``queries_pg.sql`` for PostgreSQL, each query under the same name.

``{ACTIVE}``, ``{TERMINAL}`` and ``{STARTED}`` in a query stand for the status sets of
``lmspd.store.status``, so SQL and Python share one definition of the state machine. Both files
write parameters as ``:name``; for PostgreSQL (psycopg) they become ``%(name)s``.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from lmspd.store.status import ACTIVE, STARTED, TERMINAL, sql_list

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# ``:name`` but not the ``::`` of a PostgreSQL cast.
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
_COMMENT = re.compile(r"^\s*--.*$", re.MULTILINE)  # "store:false" in a comment is no parameter
FILES = {"sqlite": "queries.sql", "postgresql": "queries_pg.sql"}


@cache
def queries(dialect: str = "sqlite") -> dict[str, str]:
    text = resources.files(__package__).joinpath(FILES[dialect]).read_text()
    for marker, statuses in (("{ACTIVE}", ACTIVE), ("{TERMINAL}", TERMINAL), ("{STARTED}", STARTED)):
        text = text.replace(marker, sql_list(statuses))
    parts = _NAME.split(text)[1:]
    found = {name: body.strip() for name, body in zip(parts[::2], parts[1::2], strict=True)}
    if dialect == "postgresql":
        found = {
            name: _PARAM.sub(r"%(\1)s", _COMMENT.sub("", sql).replace("%", "%%").strip()) for name, sql in found.items()
        }
    return found


def q(name: str, dialect: str = "sqlite") -> str:
    return queries(dialect)[name]
