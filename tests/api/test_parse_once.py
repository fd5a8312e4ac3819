"""Decode = validate, once: a request's tools, tool_choice, text and reasoning are parsed at
intake and every later stage there (the checks, the echoed response, the prompt, the grammar)
reads that form. The supervisor decodes the stored task when it runs it (it may run after a
restart), and parses it once more: two parses in all, where there were four or more."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from lmspd.config import Config, EngineConfig
from lmspd.models.registry import ResolvedModel
from lmspd.responses import tools

ENGINE = EngineConfig(weight_dtype="quantized")
TOOL = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


@pytest.fixture(scope="module")
def client(
    host: Host, tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny: ResolvedModel
) -> Iterator[TestClient]:
    config: Config = tiny_config(tiny, model_cache, tmp_path_factory.mktemp("parse-once") / "data", ENGINE)
    with host.serve(config) as client:
        yield client


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    parse = tools.tool_options

    def counted(*args: Any) -> tools.ToolOptions:
        seen.append(args)
        return parse(*args)

    monkeypatch.setattr(tools, "tool_options", counted)
    return seen


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
def test_a_request_is_parsed_once_from_intake_to_the_answer(client: TestClient, parses: list[Any], path: str) -> None:
    body: dict[str, Any] = {"temperature": 0, "tool_choice": "auto", "tools": [TOOL]}
    if path.endswith("/responses"):
        body |= {"input": "Hi", "max_output_tokens": 2, "text": {"format": {"type": "text"}}}
    else:
        body |= {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        body["tools"] = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    assert len(parses) == 2, parses  # intake, then the run


def test_a_background_response_is_parsed_at_intake_and_when_it_runs(client: TestClient, parses: list[Any]) -> None:
    r = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, "background": True, "tools": [TOOL]})
    assert r.status_code == 200, r.text
    done = client.get(f"/v1/responses/{r.json()['id']}?stream=true")  # follows it to its end
    assert done.status_code == 200
    assert len(parses) == 2, parses
