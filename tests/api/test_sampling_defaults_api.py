"""A model's sampling defaults on the real app (docs/operations.md, "Sampling defaults"): a
model whose generation_config.json says temperature 0 answers a request that names none
greedily, on every surface; both model lists show each model's defaults; a request's own
value wins; a task stores the defaults it was accepted with."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host
from harness.wait import wait_until
from lmspd.config import Config, EngineConfig, ModelEntry, ServerConfig
from lmspd.models.registry import ResolvedModel
from lmspd.responses.schema import TaskRequest

ENGINE = EngineConfig(weight_dtype="quantized")
# Greedy by the model's own file; its top_p shows which values came from where.
TUNED = {"temperature": 0, "top_p": 0.5, "repetition_penalty": 1.0, "bos_token_id": 1}
TOKENS = 24


@pytest.fixture(scope="module")
def tuned_dir(tmp_path_factory: pytest.TempPathFactory, tiny: ResolvedModel) -> Path:
    """The tiny model's files in a directory of their own, with a generation_config.json."""
    path = tmp_path_factory.mktemp("tuned") / "tuned"
    shutil.copytree(tiny.path, path)
    (path / "generation_config.json").write_text(json.dumps(TUNED))
    return path


@pytest.fixture
def client(host: Host, tmp_path: Path, model_cache: Path, tiny: ResolvedModel, tuned_dir: Path) -> Iterator[TestClient]:
    config = Config(
        default_model="tuned",
        cache_dir=str(model_cache),
        models={"tuned": ModelEntry(path=str(tuned_dir)), "plain": ModelEntry(path=str(tiny.path))},
        engine=ENGINE,
        server=ServerConfig(data_dir=str(tmp_path / "data")),
    )
    with host.serve(config) as c:
        yield c


def respond(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": TOKENS, **body})
    assert r.status_code == 200, r.text
    response: dict[str, Any] = r.json()
    return response


def text(response: dict[str, Any]) -> str:
    out: str = response["output"][0]["content"][0]["text"]
    return out


def chat(client: TestClient, **body: Any) -> str:
    messages = [{"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": TOKENS, **body})
    assert r.status_code == 200, r.text
    content: str = r.json()["choices"][0]["message"]["content"]
    return content


def test_both_model_lists_show_each_models_sampling_defaults(client: TestClient) -> None:
    expected = {
        "tuned": {"temperature": 0.0, "top_p": 0.5, "top_k": 0, "min_p": 0.0},  # its file's, then lmspd's
        "plain": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},  # lmspd's (OpenAI's)
        "smollm2-135m-instruct": {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0},  # the catalog's
    }
    for path in ("/v1/models", "/lmsp/v1/models"):
        listed = {m["id"]: m["sampling_defaults"] for m in client.get(path).json()["data"]}
        assert {name: listed[name] for name in expected} == expected, path


def test_a_request_naming_no_temperature_is_greedy_on_a_model_whose_file_says_0(client: TestClient) -> None:
    greedy = respond(client, temperature=0)
    first, second = respond(client), respond(client)
    assert text(first) == text(second) == text(greedy)
    # The response says what it sampled with: the model's values where the request named none.
    assert (first["temperature"], first["top_p"]) == (0.0, 0.5)
    assert (greedy["temperature"], greedy["top_p"]) == (0.0, 0.5)
    # Every view of the one core: Chat Completions and an LMSP task too.
    assert chat(client) == chat(client) == chat(client, temperature=0)
    body = {"type": "response", "input": {"input": "Hi", "max_output_tokens": TOKENS}}
    task_id = client.post("/lmsp/v1/tasks", json=body).json()["id"]

    def done() -> dict[str, Any] | None:
        task: dict[str, Any] = client.get(f"/lmsp/v1/tasks/{task_id}").json()
        return task if task["status"] in ("succeeded", "failed", "cancelled") else None

    task = wait_until(done, "the task to finish")
    assert task["status"] == "succeeded" and text(task["response"]) == text(greedy)


def test_a_requests_own_temperature_wins_over_the_models(client: TestClient) -> None:
    greedy = respond(client)
    sampled = respond(client, temperature=2.0, top_p=1.0)
    assert (sampled["temperature"], sampled["top_p"]) == (2.0, 1.0)
    hot = respond(client, temperature=2.0)  # its top_p still the model's
    assert (hot["temperature"], hot["top_p"]) == (2.0, 0.5)
    # Seeded (Chat Completions' seed): the same draws on the model without defaults, given the
    # same values; not the greedy answer.
    draws = [chat(client, temperature=2.0, top_p=1.0, seed=seed) for seed in range(3)]
    assert draws == [chat(client, model="plain", temperature=2.0, seed=seed) for seed in range(3)]
    assert any(draw != text(greedy) for draw in draws)


def test_a_task_stores_the_defaults_it_was_accepted_with(client: TestClient) -> None:
    response = respond(client, background=True)
    store = client.app.state.lmsp.core.store  # type: ignore[attr-defined]
    assert client.portal is not None
    task = client.portal.call(store.get_by_response, response["id"])
    stored = msgspec.json.decode(task.request, type=TaskRequest)
    assert stored.temperature is None  # as sent
    assert msgspec.to_builtins(stored.sampling_defaults) == {"temperature": 0.0, "top_p": 0.5, "top_k": 0, "min_p": 0.0}


def message(client: TestClient, **body: Any) -> str:
    """A Messages API answer's text (Claude Code names no temperature: docs/messages.md)."""
    request = {"max_tokens": TOKENS, "messages": [{"role": "user", "content": "Hi"}]} | body
    r = client.post("/v1/messages", json={"model": "tuned", **request}, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    content = r.json()["content"]
    assert [block["type"] for block in content] == ["text"], content
    out: str = content[0]["text"]
    return out


def test_the_messages_api_samples_with_the_models_defaults_too(client: TestClient) -> None:
    # Anthropic's default temperature is 1.0; lmspd's is the model's, as on every other surface.
    greedy = message(client, temperature=0)
    assert message(client) == message(client) == greedy
    # An explicit temperature wins over the model's 0 (three draws at 1: not all the greedy one).
    assert any(message(client, temperature=1.0, top_p=1.0) != greedy for _ in range(3))
    # So does an explicit top_k: 1 on a model that samples at temperature 1 by default is greedy.
    plain_greedy = message(client, model="plain", temperature=0)
    assert message(client, model="plain", top_k=1) == message(client, model="plain", top_k=1) == plain_greedy
