"""Load the named queries of ``queries.sql`` (procrastinate's style: SQL lives in .sql files).

``{ACTIVE}``, ``{TERMINAL}`` and ``{STARTED}`` in a query stand for the status sets of
``lmspd.store.status``, so SQL and Python share one definition of the state machine.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

from lmspd.store.status import ACTIVE, STARTED, TERMINAL, sql_list

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@cache
def queries() -> dict[str, str]:
    text = resources.files(__package__).joinpath("queries.sql").read_text()
    for marker, statuses in (("{ACTIVE}", ACTIVE), ("{TERMINAL}", TERMINAL), ("{STARTED}", STARTED)):
        text = text.replace(marker, sql_list(statuses))
    parts = _NAME.split(text)[1:]
    return {name: body.strip() for name, body in zip(parts[::2], parts[1::2], strict=True)}


def q(name: str) -> str:
    return queries()[name]
