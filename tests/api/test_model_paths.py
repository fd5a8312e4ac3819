"""A real ``lmspd serve`` with ``allow_model_paths = true``: what a client can name or send
that used to answer 500 or name the wrong field (issue 21, items 6 and 7).

A directory that looks like a model (it has a config.json) but holds none is the client's
404 naming ``model`` on every route, found before any task is made (it was a 500
``model_load_failed``); the built-in model's own directory named by path is the built-in
(it loaded as a second model); Chat Completions errors name Chat's fields; and
``/v1/responses/input_tokens`` refuses the sampling values create refuses."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.models import SMOL
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

QUICK: dict[str, Any] = {"input": "Hi", "temperature": 0, "max_output_tokens": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("paths")
    with tiny_server(tmp, model_cache, tiny_long, server="allow_model_paths = true\n") as srv:
        srv.start()
        yield srv


def post(server: Server, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=60)


def error_of(r: httpx.Response) -> tuple[int, str | None, str | None]:
    """(status, code, param) from a problem object or an OpenAI envelope."""
    body = r.json()
    if isinstance(body.get("error"), dict):
        return r.status_code, body["error"]["code"], body["error"]["param"]
    return r.status_code, body.get("code"), body.get("param")


def tasks(server: Server) -> int:
    with sqlite3.connect(server.config.parent / "data" / "lmspd.db") as db:
        return int(db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])


def chat(request: dict[str, Any]) -> dict[str, Any]:
    return {"model": request["model"], "messages": [{"role": "user", "content": request["input"]}]}


# Every route that takes a model, and how it carries a Responses-shaped request.
ROUTES: list[tuple[str, Any]] = [
    ("/v1/responses", lambda r: r),
    ("/v1/responses", lambda r: {**r, "stream": True}),
    ("/v1/responses", lambda r: {**r, "background": True}),
    ("/v1/responses/input_tokens", lambda r: r),
    ("/v1/responses/compact", lambda r: {"model": r["model"], "input": r["input"]}),
    ("/v1/chat/completions", chat),
    ("/v1/chat/completions", lambda r: {**chat(r), "stream": True}),
    ("/lmsp/v1/tasks", lambda r: {"type": "response", "input": r}),
    ("/lmsp/v1/responses", lambda r: r),
]


def test_a_directory_that_holds_no_model_is_the_clients_404_on_every_route(server: Server, tmp_path: Path) -> None:
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text(json.dumps({"model_type": "llama"}))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    (no_weights / "tokenizer.json").write_text("{}")
    not_json = tmp_path / "not-json"
    not_json.mkdir()
    (not_json / "config.json").write_text("{")
    before = tasks(server)
    for model, why in ((only_config, "no tokenizer.json"), (no_weights, "no weights"), (not_json, "not valid JSON")):
        for route, wrap in ROUTES:
            r = post(server, route, wrap({**QUICK, "model": str(model)}))
            assert error_of(r) == (404, "model_not_found", "model"), (route, r.text)
            message = r.json()["error"]["message"] if "error" in r.json() else r.json()["detail"]
            assert why in message and str(model) in message, message
    assert tasks(server) == before  # found before any task was made


def test_the_built_in_models_own_directory_is_that_model(server: Server, model_cache: Path) -> None:
    own = model_cache / SMOL.name
    for model in (str(own), SMOL.name, f"{own}/"):
        r = post(server, "/v1/responses", {**QUICK, "model": model})
        assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
        assert r.json()["model"] == model  # echoed as the client named it
    loads = [line for line in server.log.read_text().splitlines() if "engine loading model" in line]
    assert [line.rsplit(" ", 1)[1] for line in loads if not line.endswith(" tiny")] == [SMOL.name]


def test_chat_completions_errors_name_chats_fields(server: Server) -> None:
    long = {"messages": [{"role": "user", "content": "word " * 30_000}]}
    assert error_of(post(server, "/v1/chat/completions", long)) == (400, "context_length_exceeded", "messages")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    bad_tool = {"messages": [{"role": "user", "content": "Hi"}], "tools": [tool]}
    r = post(server, "/v1/chat/completions", bad_tool)
    assert error_of(r)[0::2] == (400, "tools[0].function.parameters"), r.text


@pytest.mark.parametrize("field", [{"temperature": -1}, {"temperature": 2.5}, {"top_p": 0}, {"top_p": 1.5}])
def test_input_tokens_refuses_the_sampling_values_create_refuses(server: Server, field: dict[str, Any]) -> None:
    (name,) = field
    for route in ("/v1/responses", "/v1/responses/input_tokens"):
        r = post(server, route, {"input": "Hi", **field})
        assert error_of(r)[0::2] == (400, name), (route, r.text)
