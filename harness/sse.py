"""Reading a server-sent event stream in tests."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def named_events(lines: Iterable[str]) -> list[tuple[str, Any]]:
    """A stream of named events (the Messages API's, docs/messages.md) as its (event, data)
    pairs, read to the end; each ``data`` names the same ``type`` as its ``event:`` line."""
    out: list[tuple[str, Any]] = []
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == kind, (kind, data)
            out.append((kind, data))
    return out
