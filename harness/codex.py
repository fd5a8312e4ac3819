"""The captured Codex CLI requests (``data/codex/``), a raw streaming POST that reads every
event, and where the real ``codex`` binary is.

``bench/agent_session.py`` builds its session on the same captured bodies.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness import DATA
from harness.capture import pinned_binary
from harness.models import CACHE

CODEX_DATA = DATA / "codex"
# The Codex CLI the suite pins (npm package @openai/codex); .ci/run installs it under the test cache.
CODEX_VERSION = "0.171.0"
CODEX_PREFIX = CACHE / "codex" / CODEX_VERSION


def body(name: str) -> dict[str, Any]:
    """A captured request body (``data/codex/<name>.json``), a fresh copy each call."""
    return dict(json.loads((CODEX_DATA / f"{name}.json").read_text()))


def headers() -> dict[str, str]:
    """The headers Codex sent with its first request (``default-turn1.headers``)."""
    lines = (CODEX_DATA / "default-turn1.headers").read_text().splitlines()[1:]
    return dict(line.split(": ", 1) for line in lines if line)


def without_reasoning_tokens(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` with every reasoning item's ``encrypted_content`` set to null (replayed
    reasoning that no lmspd sealed: Codex's capture stand-in wrote an opaque string)."""
    out = copy.deepcopy(items)
    for item in out:
        if item.get("type") == "reasoning":
            item["encrypted_content"] = None
    return out


@dataclass
class Streamed:
    """A streamed ``/v1/responses`` answer: status, headers, and either its events (each
    ``data:`` line decoded, ``event:`` checked to match) or the error body."""

    status: int
    headers: httpx.Headers
    events: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    done: bool = False  # ``data: [DONE]`` came last

    @property
    def final(self) -> dict[str, Any]:
        """The response of the terminal event (completed, incomplete or failed)."""
        assert self.events, f"no events: {self.status} {self.error}"
        last = self.events[-1]
        assert last["type"] in ("response.completed", "response.incomplete", "response.failed"), last["type"]
        return dict(last["response"])


def post_stream(url: str, payload: dict[str, Any], extra_headers: dict[str, str] | None = None) -> Streamed:
    """POST ``payload`` to ``url``/v1/responses as Codex does and read the whole answer."""
    with httpx.stream(
        "POST", f"{url}/v1/responses", json=payload, headers=extra_headers or {}, timeout=300
    ) as response:
        out = Streamed(response.status_code, response.headers)
        if response.status_code != 200:
            response.read()
            out.error = dict(response.json())
            return out
        assert response.headers["content-type"].startswith("text/event-stream"), response.headers
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == kind, (kind, event)
                out.events.append(event)
    return out


def codex_binary() -> Path | None:
    """The pinned Codex CLI (``LMSPD_CODEX``, else the test cache's, else PATH's)."""
    return pinned_binary("codex", "LMSPD_CODEX", CODEX_PREFIX)


def codex_config(base_url: str, model: str, *, web_search: bool = False, agents: bool = True) -> str:
    """The Codex config of the README's "Coding agents" section: a provider block, and unless
    ``web_search``, ``web_search = "disabled"``; without ``agents``, ``[agents] enabled =
    false`` too (what an 8k-context model needs: the sub-agent tools, the ``multi_agent_v1``
    namespace, are ~2,700 prompt tokens)."""
    search = "" if web_search else 'web_search = "disabled"\n'
    features = "" if agents else "\n[agents]\nenabled = false\n"
    return (
        f'model = "{model}"\nmodel_provider = "lmspd"\n{search}\n'
        f'[model_providers.lmspd]\nname = "lmspd"\nbase_url = "{base_url}/v1"\nwire_api = "responses"\n'
        f"{features}"
    )
