"""The seed's response and conversation store settings, conversations, and the reasoning
echo, through the real app."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, purge
from harness.families import make_thinker
from harness.wait import wait_until
from lmspd.config import Config, EngineConfig, ModelEntry, ResponsesConfig, ServerConfig
from lmspd.models.registry import ResolvedModel

QUICK = {"input": "Hi", "temperature": 0, "max_output_tokens": 3}
LONG = {"input": "Tell me a story.", "max_output_tokens": 3000, "background": True}


ENGINE = EngineConfig(weight_dtype="quantized")


@pytest.fixture
def make_client(
    host: Host, tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel
) -> Iterator[Callable[..., TestClient]]:
    with contextlib.ExitStack() as stack:
        made = 0

        def make(**responses: int) -> TestClient:
            nonlocal made
            made += 1
            config = Config(
                default_model="tiny",
                cache_dir=str(model_cache),
                models={"tiny": ModelEntry(path=str(tiny_long.path))},
                engine=ENGINE,
                server=ServerConfig(data_dir=str(tmp_path / f"data{made}")),
                responses=msgspec.convert(responses, ResponsesConfig),
            )
            return stack.enter_context(host.serve(config))

        yield make


def enforce(client: TestClient, now: int | None = None) -> None:
    state = client.app.state.lmsp  # type: ignore[attr-defined]
    assert client.portal is not None
    client.portal.call(lambda: state.core.store.enforce_response_limits(state.config.responses, now))


def error(r: Any) -> dict[str, Any]:
    return dict(r.json()["error"])


def test_conversation_keeps_a_transcript(make_client: Callable[..., TestClient]) -> None:
    c = make_client()
    r1 = c.post("/v1/responses", json={**QUICK, "input": "One.", "conversation": "conv_a"}).json()
    r2 = c.post("/v1/responses", json={**QUICK, "input": "Two.", "conversation": {"id": "conv_a"}}).json()
    count = c.post("/v1/responses/input_tokens", json={"input": "Three.", "conversation": "conv_a"}).json()
    text = [r["output"][0]["content"][0]["text"] for r in (r1, r2)]
    explicit = c.post(
        "/v1/responses/input_tokens",
        json={
            "input": [
                {"role": "user", "content": "One."},
                {"role": "assistant", "content": text[0]},
                {"role": "user", "content": "Two."},
                {"role": "assistant", "content": text[1]},
                {"role": "user", "content": "Three."},
            ]
        },
    ).json()
    assert count["input_tokens"] == explicit["input_tokens"]
    other = c.post("/v1/responses/input_tokens", json={"input": "Three.", "conversation": "conv_b"}).json()
    assert other["input_tokens"] < count["input_tokens"]
    both = c.post("/v1/responses", json={**QUICK, "conversation": "conv_a", "previous_response_id": r2["id"]})
    assert both.status_code == 400 and error(both)["param"] == "conversation"


def test_conversation_store_disabled(make_client: Callable[..., TestClient]) -> None:
    c = make_client(conversation_store_max_entries=0)
    r = c.post("/v1/responses", json={**QUICK, "conversation": "conv_a"})
    assert r.status_code == 400 and error(r)["param"] == "conversation"


def test_response_store_disabled(make_client: Callable[..., TestClient]) -> None:
    c = make_client(store_max_entries=0)
    r = c.post("/v1/responses", json=QUICK).json()
    assert r["status"] in ("completed", "incomplete")
    for method, path in [
        ("GET", f"/v1/responses/{r['id']}"),
        ("DELETE", f"/v1/responses/{r['id']}"),
        ("POST", f"/v1/responses/{r['id']}/cancel"),
    ]:
        assert c.request(method, path).status_code == 400
    assert c.post("/v1/responses", json={**QUICK, "previous_response_id": r["id"]}).status_code == 400
    bg = c.post("/v1/responses", json={**QUICK, "background": True})
    assert bg.status_code == 400 and error(bg)["param"] == "background"


@pytest.mark.parametrize("setting", ["background_max_jobs", "store_max_bytes"])
def test_zero_settings_disable_background(make_client: Callable[..., TestClient], setting: str) -> None:
    c = make_client(**{setting: 0})
    r = c.post("/v1/responses", json={**QUICK, "background": True})
    assert r.status_code == 400 and error(r)["type"] == "invalid_request_error"


def test_background_job_cap_is_429(make_client: Callable[..., TestClient]) -> None:
    c = make_client(background_max_jobs=1)
    first = c.post("/v1/responses", json=LONG).json()
    second = c.post("/v1/responses", json=LONG)
    assert second.status_code == 429 and second.headers["retry-after"]
    assert error(second)["type"] == "rate_limit_exceeded"
    assert c.post(f"/v1/responses/{first['id']}/cancel").json()["status"] == "cancelled"
    assert c.post("/v1/responses", json=LONG).status_code == 200


def test_store_entry_cap_evicts_the_oldest(make_client: Callable[..., TestClient]) -> None:
    c = make_client(store_max_entries=2)
    ids = [c.post("/v1/responses", json=QUICK).json()["id"] for _ in range(3)]
    enforce(c)
    assert [c.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200]


def test_store_byte_budget_and_ttl(make_client: Callable[..., TestClient]) -> None:
    c = make_client(store_max_bytes=3000, store_ttl_secs=60)
    ids = [c.post("/v1/responses", json=QUICK).json()["id"] for _ in range(3)]
    enforce(c)
    kept = [c.get(f"/v1/responses/{i}").status_code for i in ids]
    assert kept[-1] == 200 and 404 in kept  # the newest fits, the oldest did not
    enforce(c, now=int(time.time()) + 61)
    assert c.get(f"/v1/responses/{ids[-1]}").status_code == 404


def test_ephemeral_background_result_expires(make_client: Callable[..., TestClient]) -> None:
    c = make_client(background_ephemeral_ttl_secs=5)
    r = c.post("/v1/responses", json={**QUICK, "background": True, "store": False}).json()
    waiting = ("queued", "in_progress")
    wait_until(lambda: c.get(f"/v1/responses/{r['id']}").json()["status"] not in waiting, "the response to end")
    purge(c, later_by=6)
    assert c.get(f"/v1/responses/{r['id']}").status_code == 404


def test_conversation_caps_drop_old_transcripts(make_client: Callable[..., TestClient]) -> None:
    c = make_client(conversation_store_max_entries=1)
    c.post("/v1/responses", json={**QUICK, "conversation": "old"})
    c.post("/v1/responses", json={**QUICK, "conversation": "new"})
    enforce(c)
    alone = c.post("/v1/responses/input_tokens", json={"input": "Next"}).json()["input_tokens"]
    assert (
        c.post("/v1/responses/input_tokens", json={"input": "Next", "conversation": "old"}).json()["input_tokens"]
        == alone
    )
    assert (
        c.post("/v1/responses/input_tokens", json={"input": "Next", "conversation": "new"}).json()["input_tokens"]
        > alone
    )


# --- the reasoning echo ------------------------------------------------------------------------

TOKENS = {"alice": "sk-alice", "bob": "sk-bob"}
THINK = {"input": "Hi", "temperature": 0, "max_output_tokens": 8}
Serve = Callable[..., contextlib.AbstractContextManager[TestClient]]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    """Its greedy answer to ``THINK``: two tokens of reasoning, ``</think>``, a message."""
    return make_thinker(tmp_path_factory.mktemp("echo") / "thinker", smol_dir, str(THINK["input"]))


@pytest.fixture
def serve(host: Host, tmp_path: Path, model_cache: Path, thinker: Path) -> Serve:
    """An app on the thinker with tokens for alice and bob; every app of a test shares its data."""

    def make(**responses: int) -> contextlib.AbstractContextManager[TestClient]:
        config = Config(
            default_model="thinker",
            cache_dir=str(model_cache),
            models={"thinker": ModelEntry(path=str(thinker))},
            engine=ENGINE,
            server=ServerConfig(data_dir=str(tmp_path / "echo"), tokens=TOKENS),
            responses=msgspec.convert(responses, ResponsesConfig),
        )
        return host.serve(config)

    return make


def auth(owner: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[owner]}"}


def reasoned_turn(client: TestClient) -> tuple[list[Any], list[Any]]:
    """Alice's first turn; then the next turn's input with the items as returned, and as a
    client sending history by hand, without the reasoning item."""
    r = client.post("/v1/responses", json=THINK, headers=auth("alice"))
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"], output
    user, more = {"role": "user", "content": "Hi"}, {"role": "user", "content": "And?"}
    by_hand = [user, {"role": "assistant", "content": output[1]["content"][0]["text"]}, more]
    return [user, *output, more], by_hand


def count(client: TestClient, owner: str, items: list[Any]) -> int:
    r = client.post("/v1/responses/input_tokens", json={"input": items}, headers=auth(owner))
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


def test_reasoning_echo_renders_a_turn_sent_back_without_its_reasoning_as_generated(serve: Serve) -> None:
    with serve() as c:
        returned, by_hand = reasoned_turn(c)
        as_generated = count(c, "alice", returned)
        assert count(c, "alice", by_hand) == as_generated
        # What runs is what was counted and checked: the next turn itself.
        r = c.post("/v1/responses", json={**THINK, "input": by_hand, "max_output_tokens": 1}, headers=auth("alice"))
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == as_generated, r.text
        # One owner's reasoning is never put into another's request.
        assert count(c, "bob", by_hand) < count(c, "bob", returned) == as_generated
    with serve() as c:  # kept in SQLite: after a restart it is still put back
        assert count(c, "alice", by_hand) == as_generated


def test_reasoning_echo_off_with_a_zero_budget(serve: Serve) -> None:
    with serve(reasoning_echo_max_bytes=0) as c:
        returned, by_hand = reasoned_turn(c)
        assert count(c, "alice", by_hand) < count(c, "alice", returned)
