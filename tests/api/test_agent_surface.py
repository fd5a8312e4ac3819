"""What coding agents send (docs/responses.md, "Coding agents"): sealed reasoning, item
references, client_metadata, namespace tools and hosted tools, through the real app and engine.

The thinker (harness/families.py) reasons for two tokens and then answers, so its
reasoning items are real; the tiny model's calls are valid only because the grammar holds them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host
from harness.families import make_thinker
from harness.openresponses import validate
from lmspd.config import Config, EngineConfig, ModelEntry, ResponsesConfig, ServerConfig
from lmspd.models.registry import ResolvedModel

ENGINE = EngineConfig(weight_dtype="quantized")
TOKENS = {"alice": "sk-alice", "bob": "sk-bob"}
THINK = {"input": "Hi", "temperature": 0, "max_output_tokens": 8}
SEALED = {**THINK, "include": ["reasoning.encrypted_content"], "store": False}
Serve = Callable[..., contextlib.AbstractContextManager[TestClient]]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    return make_thinker(tmp_path_factory.mktemp("agents") / "thinker", smol_dir, str(THINK["input"]))


@pytest.fixture
def serve(host: Host, tmp_path: Path, model_cache: Path, thinker: Path, tiny_long: ResolvedModel) -> Serve:
    """An app on the thinker (default) and the tiny model, with tokens for alice and bob. The
    reasoning echo is off, so only what a request itself carries can restore its reasoning."""

    def make(data: str = "data", **responses: Any) -> contextlib.AbstractContextManager[TestClient]:
        config = Config(
            default_model="thinker",
            cache_dir=str(model_cache),
            models={"thinker": ModelEntry(path=str(thinker)), "tiny": ModelEntry(path=str(tiny_long.path))},
            engine=ENGINE,
            server=ServerConfig(data_dir=str(tmp_path / data), tokens=TOKENS),
            responses=msgspec.convert({"reasoning_echo_max_bytes": 0, **responses}, ResponsesConfig),
        )
        return host.serve(config)

    return make


def auth(owner: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[owner]}"}


def count(client: TestClient, owner: str, items: list[Any]) -> int:
    r = client.post("/v1/responses/input_tokens", json={"input": items}, headers=auth(owner))
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


def tasks_of(client: TestClient, owner: str) -> int:
    r = client.get("/lmsp/v1/tasks", params={"limit": 100}, headers=auth(owner))
    assert r.status_code == 200, r.text
    return len(r.json()["data"])


def sealed_turn(client: TestClient) -> tuple[dict[str, Any], dict[str, Any]]:
    """Alice's first turn with sealed reasoning: the reasoning item and the message."""
    r = client.post("/v1/responses", json=SEALED, headers=auth("alice"))
    assert r.status_code == 200, r.text
    validate("ResponseResource", r.json())
    reasoning, message = r.json()["output"]
    assert reasoning["type"] == "reasoning" and message["type"] == "message"
    assert reasoning["encrypted_content"].startswith("lmspd.r1.")
    return reasoning, message


def as_codex_sends(reasoning: dict[str, Any]) -> dict[str, Any]:
    """Codex replays a reasoning item without its id and without reasoning_text content."""
    return {"type": "reasoning", "summary": [], "encrypted_content": reasoning["encrypted_content"]}


def test_sealed_reasoning_restores_the_turn_as_generated(serve: Serve) -> None:
    user, more = {"role": "user", "content": "Hi"}, {"role": "user", "content": "And?"}
    with serve() as c:
        reasoning, message = sealed_turn(c)
        as_generated = count(c, "alice", [user, reasoning, message, more])
        replayed = [user, as_codex_sends(reasoning), message, more]
        assert count(c, "alice", replayed) == as_generated
        assert count(c, "alice", [user, message, more]) < as_generated  # without it: not as generated
        # What runs is what was counted: the next turn itself, streamed as Codex asks for it.
        body = {**SEALED, "input": replayed, "stream": True, "max_output_tokens": 1}
        with c.stream("POST", "/v1/responses", json=body, headers=auth("alice")) as r:
            assert r.status_code == 200
            events = [msgspec.json.decode(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["type"] == "response.incomplete"  # one token of budget
        assert events[-1]["response"]["usage"]["input_tokens"] == as_generated
        # A reasoning item whose encrypted_content is null is an ordinary one.
        assert count(c, "alice", [user, {**reasoning, "encrypted_content": None}, message, more]) == as_generated
    with serve() as c:  # the key is in the data directory: it still opens after a restart
        assert count(c, "alice", replayed) == as_generated


def refused(client: TestClient, owner: str, items: list[Any]) -> dict[str, Any]:
    r = client.post("/v1/responses", json={**SEALED, "input": items}, headers=auth(owner))
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    return error


def test_a_seal_that_does_not_verify_is_a_400_naming_the_item(serve: Serve) -> None:
    user = {"role": "user", "content": "Hi"}
    with serve() as c:
        reasoning, message = sealed_turn(c)
        token = reasoning["encrypted_content"]
        before = {owner: tasks_of(c, owner) for owner in TOKENS}
        flipped = token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1]
        for bad in (flipped, token + "x", "lmspd.r1.", "gAAAA-openai-sealed", token.removeprefix("lmspd.r1.")):
            error = refused(c, "alice", [user, {**as_codex_sends(reasoning), "encrypted_content": bad}, message])
            assert error["param"] == "input[1].encrypted_content", error
        # Sealed for alice: bob cannot pass it off as his.
        assert refused(c, "bob", [user, as_codex_sends(reasoning), message])["param"] == "input[1].encrypted_content"
        # An id that is not the one sealed.
        other_id = {**as_codex_sends(reasoning), "id": "rs_other"}
        assert refused(c, "alice", [user, other_id, message])["param"] == "input[1].id"
        assert {owner: tasks_of(c, owner) for owner in TOKENS} == before  # nothing written
    with serve(data="elsewhere") as c:  # another data directory: another key
        assert refused(c, "alice", [user, as_codex_sends(reasoning), message])["param"] == "input[1].encrypted_content"


def test_item_reference_resolves_to_the_owners_stored_item(serve: Serve) -> None:
    user, more = {"role": "user", "content": "Hi"}, {"role": "user", "content": "And?"}
    with serve() as c:
        r = c.post("/v1/responses", json=THINK, headers=auth("alice"))
        assert r.status_code == 200, r.text
        reasoning, message = r.json()["output"]
        whole = count(c, "alice", [user, reasoning, message, more])
        refs = [user, {"type": "item_reference", "id": reasoning["id"]}, {"id": message["id"]}, more]
        assert count(c, "alice", refs) == whole  # type may be left out, as Open Responses allows
        r = c.post("/v1/responses", json={**THINK, "input": refs, "max_output_tokens": 1}, headers=auth("alice"))
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == whole, r.text
        before = tasks_of(c, "bob")
        r = c.post("/v1/responses", json={**THINK, "input": refs}, headers=auth("bob"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].id", r.text
        assert "not found" in r.json()["error"]["message"]  # the same answer as for no such item
        r = c.post(
            "/v1/responses",
            json={**THINK, "input": [{"type": "item_reference", "id": "msg_nope"}]},
            headers=auth("alice"),
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].id", r.text
        assert tasks_of(c, "bob") == before
        # A store:false response's items cannot be referenced: nothing of it is kept to find.
        r = c.post("/v1/responses", json={**THINK, "store": False}, headers=auth("alice"))
        gone = r.json()["output"][-1]["id"]
        r = c.post(
            "/v1/responses", json={**THINK, "input": [{"type": "item_reference", "id": gone}]}, headers=auth("alice")
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].id", r.text


def test_client_metadata_is_accepted_and_bounded(serve: Serve) -> None:
    with serve() as c:
        tags = {"thread_id": "t-1", "x-codex-turn-metadata": '{"turn_id": "u-1"}' * 50}
        r = c.post("/v1/responses", json={**THINK, "client_metadata": tags}, headers=auth("alice"))
        assert r.status_code == 200, r.text
        plain = c.post("/v1/responses", json=THINK, headers=auth("alice"))
        assert r.json()["usage"]["input_tokens"] == plain.json()["usage"]["input_tokens"]  # never rendered
        for bad in ({"k": 1}, {f"k{i}": "v" for i in range(65)}, {"k": "v" * 70000}):
            r = c.post("/v1/responses", json={**THINK, "client_metadata": bad}, headers=auth("alice"))
            assert r.status_code == 400 and r.json()["error"]["param"].startswith("client_metadata"), r.text


AGENTS = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"target": {"type": "string", "maxLength": 8}},
                "required": ["target"],
                "additionalProperties": False,
            },
        }
    ],
}
SEARCH = {"type": "web_search", "external_web_access": False}


def test_namespace_tools_call_and_round_trip(serve: Serve) -> None:
    with serve() as c:
        body = {
            "model": "tiny",
            "input": "Close it.",
            "tools": [AGENTS],
            "tool_choice": "required",
            "max_output_tokens": 64,
        }
        r = c.post("/v1/responses", json={**body, "parallel_tool_calls": False}, headers=auth("alice"))
        assert r.status_code == 200, r.text
        validate("ResponseResource", r.json())
        (call,) = r.json()["output"]
        assert call["type"] == "function_call" and call["name"] == "close_agent", call
        assert call["namespace"] == "multi_agent_v1"
        assert r.json()["tools"][0]["type"] == "namespace"  # echoed as declared
        history = [{"role": "user", "content": "Close it."}, call]
        history.append({"type": "function_call_output", "call_id": call["call_id"], "output": "closed"})
        r = c.post(
            "/v1/responses",
            json={**body, "input": history, "tool_choice": "auto", "max_output_tokens": 4},
            headers=auth("alice"),
        )
        assert r.status_code == 200, r.text
        # Named by its own name (unambiguous) or by its qualified one.
        for name in ("close_agent", "multi_agent_v1.close_agent"):
            choice = {"type": "function", "name": name}
            r = c.post("/v1/responses", json={**body, "tool_choice": choice}, headers=auth("alice"))
            assert r.status_code == 200 and r.json()["output"][0]["namespace"] == "multi_agent_v1", r.text


def test_hosted_tools_are_refused_by_default_and_omitted_when_configured(serve: Serve) -> None:
    body = {"model": "tiny", "input": "Hi", "tools": [SEARCH, AGENTS], "max_output_tokens": 2}
    with serve() as c:
        r = c.post("/v1/responses", json=body, headers=auth("alice"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type", r.text
        message = r.json()["error"]["message"]
        assert 'web_search = "disabled"' in message and 'hosted_tools = "omit"' in message
    with serve(hosted_tools="omit") as c:
        r = c.post("/v1/responses", json=body, headers=auth("alice"))
        assert r.status_code == 200, r.text
        assert r.headers["lmspd-omitted-tools"] == "web_search"
        assert [t["type"] for t in r.json()["tools"]] == ["namespace"]
        r = c.post("/v1/responses/input_tokens", json=body, headers=auth("alice"))
        assert r.status_code == 200 and r.headers["lmspd-omitted-tools"] == "web_search"
        r = c.post("/v1/responses", json={**body, "tools": [AGENTS]}, headers=auth("alice"))
        assert "lmspd-omitted-tools" not in r.headers
