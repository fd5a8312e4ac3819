"""What an adversarial round found still answering 500, or accepted where create refuses it
(issue 41): ``/responses/compact`` skipping intake's resolution of references and seals, an
item reference inside a compaction payload, and ``type`` fields that are no string."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness import fuzz_attacks
from harness.engine_host import Host, tiny_config
from lmspd.config import Config, EngineConfig, ResponsesConfig
from lmspd.models.registry import ResolvedModel

TOKENS = {"alice": "alice-secret-token", "bob": "bob-secret-token"}
ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}
ENGINE = EngineConfig(weight_dtype="quantized")  # test_intake_hardening's engine: one host for both
QUICK: dict[str, Any] = {"input": "Hi", "temperature": 0, "max_output_tokens": 2}
USER = {"role": "user", "content": "Hi"}
Wrap = Callable[[dict[str, Any]], dict[str, Any]]


def config_for(tmp: Path, model_cache: Path, tiny: ResolvedModel, **responses: Any) -> Config:
    config = tiny_config(tiny, model_cache, tmp / "data", ENGINE, tokens=TOKENS, keepalive_secs=0.5)
    return msgspec.structs.replace(config, responses=msgspec.convert(responses, ResponsesConfig))


@pytest.fixture(scope="module")
def client(
    host: Host, tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel
) -> Iterator[TestClient]:
    with host.serve(config_for(tmp_path_factory.mktemp("round3"), model_cache, tiny_long)) as c:
        yield c


@pytest.fixture(scope="module")
def omitting(
    host: Host, tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel
) -> Iterator[TestClient]:
    """An app that leaves hosted tools out (``hosted_tools = "omit"``) instead of refusing them."""
    tmp = tmp_path_factory.mktemp("round3-omit")
    with host.serve(config_for(tmp, model_cache, tiny_long, hosted_tools="omit")) as c:
        yield c


def same(request: dict[str, Any]) -> dict[str, Any]:
    return request


def as_task(request: dict[str, Any]) -> dict[str, Any]:
    return {"type": "response", "input": request}


def as_compact(request: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in request.items() if k in ("model", "input", "max_output_tokens", "keep_tokens")}


COMPACTS: list[tuple[str, Wrap]] = [("/v1/responses/compact", as_compact), ("/lmsp/v1/responses/compact", as_compact)]
# Every route that takes a Responses request's input and tools.
CREATES: list[tuple[str, Wrap]] = [
    ("/v1/responses", same),
    ("/v1/responses/input_tokens", same),
    ("/lmsp/v1/responses", same),
    ("/lmsp/v1/tasks", as_task),
]
INPUTS = CREATES + COMPACTS


def ids(routes: list[tuple[str, Wrap]]) -> list[str]:
    return [route for route, _ in routes]


def refusal(r: Any, route: str) -> dict[str, Any]:
    """A 400 in the route's error shape: OpenAI's envelope on /v1, a problem object on /lmsp/v1;
    its message and param."""
    assert r.status_code == 400, r.text
    body = r.json()
    if route.startswith("/lmsp/"):
        assert r.headers["content-type"] == "application/problem+json", r.headers
        assert body["status"] == 400 and body["code"] == "invalid_request", body
        return {"message": body["detail"], "param": body["param"]}
    assert r.headers["content-type"] == "application/json", r.headers
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error", body
    return {"message": body["error"]["message"], "param": body["error"]["param"]}


def in_route(route: str, param: str) -> str:
    """``param`` as the route names it: a task's request is the envelope's ``input``."""
    return f"input.{param}" if route == "/lmsp/v1/tasks" else param


def tasks_of(client: TestClient, headers: dict[str, str]) -> list[str]:
    r = client.get("/lmsp/v1/tasks", params={"limit": 100}, headers=headers)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["data"]]


def payload(items: list[Any], summary: str = "Earlier: a greeting.") -> str:
    """A compaction item's encrypted_content (lmspd.responses.inputs.encode_payload's format)."""
    return base64.urlsafe_b64encode(msgspec.json.encode({"summary": summary, "items": items})).decode().rstrip("=")


def stored_item(client: TestClient, headers: dict[str, str]) -> dict[str, Any]:
    r = client.post("/v1/responses", json={**QUICK, "max_output_tokens": 16}, headers=headers)
    assert r.status_code == 200, r.text
    item: dict[str, Any] = r.json()["output"][-1]
    return item


def seal(client: TestClient, owner: str, item_id: str, text: str) -> str:
    token: str = client.app.state.lmsp.core.intake.sealer.seal(owner, item_id, text)  # type: ignore[attr-defined]
    return token


def reasoning(encrypted: str) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [], "encrypted_content": encrypted}


# --- /responses/compact resolves references and opens seals as create does ----------------------

LONG = {"role": "user", "content": "Tell me everything you know about the cats of Rome. " * 8}
MORE = {"role": "user", "content": "And the dogs?"}


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
@pytest.mark.parametrize(("route", "wrap"), COMPACTS, ids=ids(COMPACTS))
def test_compact_refuses_a_reference_as_create_does(client: TestClient, route: str, wrap: Wrap, typed: bool) -> None:
    bobs = stored_item(client, BOB)["id"]
    for target in ("msg_no_such_item", bobs):
        reference = {"type": "item_reference", "id": target} if typed else {"id": target}
        request = {**QUICK, "input": [LONG, reference, MORE]}
        before = tasks_of(client, ALICE)
        error = refusal(client.post(route, json=wrap(request), headers=ALICE), route)
        assert error["param"] == "input[1].id" and "not found" in error["message"], error
        # Word for word what create answers: one resolution for both.
        assert error == refusal(client.post("/v1/responses", json=request, headers=ALICE), "/v1/responses")
        assert tasks_of(client, ALICE) == before


@pytest.mark.parametrize(("route", "wrap"), COMPACTS, ids=ids(COMPACTS))
def test_compact_refuses_a_seal_as_create_does(client: TestClient, route: str, wrap: Wrap) -> None:
    answer = {"role": "assistant", "content": "Many."}
    for token in (seal(client, "bob", "rs_bobs", "bob's thoughts"), "lmspd.r1.not-a-real-seal", "lmspd.r1."):
        request = {**QUICK, "input": [LONG, reasoning(token), answer, MORE]}
        before = tasks_of(client, ALICE)
        error = refusal(client.post(route, json=wrap(request), headers=ALICE), route)
        assert error["param"] == "input[1].encrypted_content", error
        assert error == refusal(client.post("/v1/responses", json=request, headers=ALICE), "/v1/responses")
        assert tasks_of(client, ALICE) == before
    # A seal whose id is not the item's.
    request = {**QUICK, "input": [LONG, {**reasoning(seal(client, "alice", "rs_a", "t")), "id": "rs_b"}, answer, MORE]}
    error = refusal(client.post(route, json=wrap(request), headers=ALICE), route)
    assert error["param"] == "input[1].id", error


@pytest.mark.parametrize(("route", "wrap"), COMPACTS, ids=ids(COMPACTS))
def test_compact_summarizes_the_items_a_reference_and_a_seal_stand_for(
    client: TestClient, route: str, wrap: Wrap
) -> None:
    """The caller's own reference and seal compact exactly as the items themselves do."""
    answer = stored_item(client, ALICE)
    thought = "The cats of Rome live in the ruins."
    token = seal(client, "alice", "rs_own", thought)
    opened = {**reasoning(token), "id": "rs_own", "content": [{"type": "reasoning_text", "text": thought}]}
    base = {**QUICK, "keep_tokens": 1}
    sent = [LONG, {**reasoning(token), "id": "rs_own"}, {"type": "item_reference", "id": answer["id"]}, MORE]
    r = client.post(route, json=wrap({**base, "input": sent}), headers=ALICE)
    assert r.status_code == 200, r.text
    inline = client.post(route, json=wrap({**base, "input": [LONG, opened, answer, MORE]}), headers=ALICE)
    assert inline.status_code == 200, inline.text
    compacted, expected = r.json(), inline.json()
    assert compacted["usage"] == expected["usage"]
    assert [i["type"] for i in compacted["output"]] == [i["type"] for i in expected["output"]]
    # The compaction item carries the summary and what it preserves: the same, item for item.
    assert compacted["output"][-1]["encrypted_content"] == expected["output"][-1]["encrypted_content"]


# --- an item reference inside a compaction payload --------------------------------------------


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "untyped"])
@pytest.mark.parametrize(("route", "wrap"), INPUTS, ids=ids(INPUTS))
def test_a_reference_inside_a_compaction_payload_is_a_400(
    client: TestClient, route: str, wrap: Wrap, typed: bool
) -> None:
    own = stored_item(client, ALICE)["id"]  # even one the caller could reference at the top level
    for target in ("msg_no_such_item", own):
        reference = {"type": "item_reference", "id": target} if typed else {"id": target}
        compaction = {"type": "compaction", "encrypted_content": payload([USER, reference])}
        before = tasks_of(client, ALICE)
        r = client.post(route, json=wrap({**QUICK, "input": [compaction, MORE]}), headers=ALICE)
        error = refusal(r, route)
        assert error["param"] == in_route(route, "input[0].encrypted_content"), error
        assert "items[1]" in error["message"] and "item reference" in error["message"], error
        assert tasks_of(client, ALICE) == before


# --- type fields that are no string -----------------------------------------------------------

NOT_STRINGS: list[Any] = [[], {}, ["function"], {"type": "function"}]
FUNCTION = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("hosted", ["refuse", "omit"])
@pytest.mark.parametrize("kind", NOT_STRINGS, ids=repr)
@pytest.mark.parametrize(("route", "wrap"), CREATES, ids=ids(CREATES))
def test_a_tool_type_that_is_no_string_is_a_400(
    client: TestClient, omitting: TestClient, route: str, wrap: Wrap, kind: Any, hosted: str
) -> None:
    app = omitting if hosted == "omit" else client
    request = {**QUICK, "tools": [FUNCTION, {"type": kind, "name": "x"}]}
    before = tasks_of(app, ALICE)
    error = refusal(app.post(route, json=wrap(request), headers=ALICE), route)
    assert error["param"] == in_route(route, "tools[1].type"), error
    assert tasks_of(app, ALICE) == before


@pytest.mark.parametrize("kind", NOT_STRINGS, ids=repr)
@pytest.mark.parametrize(("route", "wrap"), INPUTS, ids=ids(INPUTS))
def test_an_item_or_part_type_that_is_no_string_is_a_400(client: TestClient, route: str, wrap: Wrap, kind: Any) -> None:
    cases = [
        ([USER, {"type": kind}], "input[1].type"),
        ([USER, {"type": kind, "role": "user", "content": "Hi"}], "input[1].type"),
        ([{"role": "user", "content": [{"type": kind, "text": "Hi"}]}], "input[0].content[0].type"),
        ([{"type": "compaction", "encrypted_content": payload([{"type": kind}])}, MORE], "input[0].encrypted_content"),
    ]
    for items, param in cases:
        before = tasks_of(client, ALICE)
        error = refusal(client.post(route, json=wrap({**QUICK, "input": items}), headers=ALICE), route)
        assert error["param"] == in_route(route, param), (items, error)
        assert tasks_of(client, ALICE) == before


# --- the fuzz harness's hand-written attacks (harness.fuzz_attacks) -------------------------------


def test_the_fuzz_harness_attacks_are_each_answered_as_it_requires(client: TestClient) -> None:
    """What ``harness.fuzz`` sends after schemathesis, on every documented POST route, held to
    the harness's own verdict: it must find nothing here, as it must on a real server."""
    paths = client.get("/openapi.json").json()["paths"]
    posts = {path for path, ops in paths.items() if "post" in ops and "{" not in path}
    cases = fuzz_attacks.attacks(posts, stored_item(client, ALICE)["id"], stored_item(client, BOB)["id"])
    reached = {case.path for case in cases}
    assert {route for route, _ in INPUTS} <= reached and "/v1/chat/completions" in reached
    faults = [fuzz_attacks.fault(case, client.post(case.path, json=case.body, headers=ALICE)) for case in cases]
    assert [f for f in faults if f is not None] == []
