"""Claude Code 2.1.332's own requests (``harness/data/claude/``, its README says how they were
captured) replayed against the real app, with the headers Claude Code sent, on a tiny model
with the bundled model's context (8192 tokens): the default request (twelve tools, ~12,000
tokens) is refused in Anthropic's words, the form Claude Code reports as "Prompt is too long";
the ``--tools "Bash,Read,Edit"`` requests (~3,700 tokens), turn 1 and turn 2 (a ``tool_use``
and Claude Code's ``tool_result``), are accepted and streamed to their end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.claude import captured
from harness.engine_host import Host
from harness.sse import named_events
from lmspd.config import Config, EngineConfig, ModelEntry, ServerConfig
from lmspd.models.registry import ResolvedModel

ENGINE = EngineConfig(weight_dtype="quantized")
# What a client does not choose (the connection's own), left out of the replayed headers.
HOP = ("host", "content-length", "connection", "accept-encoding")


@pytest.fixture(scope="module")
def client(
    host: Host, tmp_path_factory: pytest.TempPathFactory, model_cache: Path, brief_8k: ResolvedModel
) -> Iterator[TestClient]:
    """The app on the captured requests' model name, ``tiny``: the brief tiny model with an 8k
    context, ``sk-local`` (the key Claude Code sent) its token."""
    data = tmp_path_factory.mktemp("claude-replay")
    config = Config(
        default_model="tiny",
        cache_dir=str(model_cache),  # the session's: the shared engine's settings derive from it
        models={"tiny": ModelEntry(path=str(brief_8k.path))},
        engine=ENGINE,
        server=msgspec.convert({"data_dir": str(data / "data"), "tokens": {"local": "sk-local"}}, ServerConfig),
    )
    with host.serve(config) as c:
        yield c


def replay(client: TestClient, name: str) -> tuple[int, Any]:
    """POST the captured request ``name`` as Claude Code sent it: the status, and the error body
    or the stream's (event, data) pairs read to the end."""
    request = captured(name)
    headers = {k: v for k, v in request["headers"].items() if k not in HOP}
    assert request["method"] == "POST" and request["path"] == "/v1/messages?beta=true"
    with client.stream("POST", request["path"], content=json.dumps(request["body"]), headers=headers) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        assert r.headers["content-type"].startswith("text/event-stream")
        return r.status_code, named_events(r.iter_lines())


@pytest.mark.parametrize("name", ["default-turn1", "default-turn2"])
def test_the_default_twelve_tools_are_too_long_for_8k(client: TestClient, name: str) -> None:
    status, error = replay(client, name)
    assert status == 400 and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error", error
    found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", error["error"]["message"])
    assert found is not None, error
    assert int(found[2]) == 8191 and 10_000 < int(found[1]) < 14_000, found[0]  # ~12,000 tokens


@pytest.mark.parametrize("name", ["three-tools-turn1", "three-tools-turn2"])
def test_the_three_tools_request_is_answered(client: TestClient, name: str) -> None:
    status, events = replay(client, name)
    assert status == 200, events
    kinds = [kind for kind, _ in events if kind != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert "error" not in kinds, events
    delta = events[-2][1] if events[-1][0] == "message_stop" else None
    assert delta is not None and delta["delta"]["stop_reason"] in ("end_turn", "tool_use", "max_tokens"), delta
    usage = delta["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert 3_000 < prompt < 8_191, usage  # all of it read: ~3,700 tokens with the three tools


def test_the_captures_are_what_their_readme_says() -> None:
    """Twelve tools by default, three (and the deferred placeholder) with ``--tools``; turn 2
    ends with the stand-in's ``tool_use`` and Claude Code's ``tool_result``."""
    default, small = captured("default-turn1")["body"], captured("three-tools-turn1")["body"]
    assert len(default["tools"]) == 12 and [t["name"] for t in small["tools"] if not t.get("defer_loading")] == [
        "Bash",
        "Edit",
        "Read",
    ]
    *_, use, result = captured("three-tools-turn2")["body"]["messages"]
    assert use["content"][-1]["type"] == "tool_use" and result["content"][0]["type"] == "tool_result"
