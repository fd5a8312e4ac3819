"""Tenancy matrix (docs/lmsp.md §9.1), generated from the app's own routes: every route × {no token,
wrong token (as a Bearer or an x-api-key), another tenant's token}, on /v1, its aliases and /lmsp/v1 alike.

A route added to the app is in the matrix without a change here; one whose path parameter or
request body this file cannot fill fails ``test_tenancy`` until it is taught here or listed in
PUBLIC. Alice owns a task, a background response and a conversation; then:
- without a token or with a wrong one, every route but the public ones answers 401 with
  ``WWW-Authenticate: Bearer`` in its surface's error shape;
- with Bob's token, naming Alice's resources (path, ``previous_response_id``, ``conversation``,
  event streams with ``Last-Event-ID``, ``input_items``) is indistinguishable from naming ones
  that do not exist (404 on paths), and no answer to Bob ever carries Alice's ids or prompt;
- afterwards Alice's resources are intact and hers alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import ulid
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from harness.wait import wait_until
from lmspd.api import console
from lmspd.api.app import ROUTES
from lmspd.api.openapi import documented
from lmspd.config import EngineConfig
from lmspd.models.registry import ResolvedModel

ENGINE = EngineConfig(weight_dtype="quantized")
TOKENS = {"alice": "tenancy-alice-token", "bob": "tenancy-bob-token"}
PUBLIC = {("/healthz", "get"), ("/lmsp/v1/healthz", "get"), ("/readyz", "get"), ("/openapi.json", "get")}
PUBLIC |= {(route.path, "get") for route in console.ROUTES}  # the page and its assets hold no data
SECRET = "Alice's secret prompt: the vault code is 7741."
CONVERSATION = "conv_tenancy_alice"  # Alice's; each call naming one gets a new one (see _fresh_conversation)
ROUTE_LIST = documented(ROUTES)


@dataclass
class Alice:
    task_id: str
    task_response_id: str
    response_id: str

    def ids(self) -> dict[str, str]:
        return {"task_id": self.task_id, "response_id": self.response_id}

    def marks(self) -> list[str]:
        """What must never reach another tenant."""
        return [self.task_id, self.task_response_id, self.response_id, SECRET, "7741"]


@dataclass
class Call:
    method: str
    url: str
    body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    names_alices: bool = False  # names a resource of Alice's (in the path or the body)
    stands_for: list[str] = field(default_factory=list)  # the made-up ids of elsewhere()

    def replace(self, old: str, new: str) -> Call:
        url, body = json.loads(json.dumps([self.url, self.body]).replace(old, new))
        return Call(self.method, url, body, self.headers, self.names_alices, self.stands_for)

    def elsewhere(self, alice: Alice, conversation: str) -> Call:
        """The same call naming resources that do not exist (an unused conversation name for
        a conversation: each tenant's conversation names are its own)."""
        text = json.dumps([self.url, self.body])
        made: list[str] = []
        for old in (alice.task_id, alice.response_id, alice.task_response_id, conversation):
            made.append(f"{old.partition('_')[0]}_{ulid.new()}")
            text = text.replace(old, made[-1])
        url, body = json.loads(text)
        return Call(self.method, url, body, self.headers, self.names_alices, made)


def _surface_path(path: str) -> str:
    for prefix in ("/lmsp/v1", "/v1"):
        if path.startswith(prefix + "/"):
            return path[len(prefix) :]
    return path


def calls(path: str, method: str, alice: Alice) -> list[Call]:
    """The requests that try ``method path`` on Alice's things; LookupError if this file does
    not know how to (a new path parameter, a new request body)."""
    url = path
    names = False
    for param in (p.strip("{}") for p in path.split("/") if p.startswith("{")):
        if param == "name":  # a model: no tenant's (its control routes are operators')
            url = url.replace("{name}", "tiny")
            continue
        if param not in alice.ids():
            raise LookupError(f"path parameter {param!r}")
        url = url.replace(f"{{{param}}}", alice.ids()[param])
        names = True
    base = Call(method.upper(), url, names_alices=names)
    route = _surface_path(path)
    quick = {"input": "Hello", "max_output_tokens": 2, "temperature": 0}
    if method == "get":
        if route == "/responses/{response_id}":
            return [base, Call("GET", url + "?stream=true", names_alices=True)]
        if route == "/tasks/{task_id}/events":
            return [base, Call("GET", url, headers={"Last-Event-ID": "0"}, names_alices=True)]
        if route == "/responses/{response_id}/input_items":
            return [base, Call("GET", url + "?order=asc&limit=100", names_alices=True)]
        return [base]
    if method == "delete":
        return [base]
    if method != "post":
        raise LookupError(f"method {method}")
    if route in ("/responses/{response_id}/cancel", "/tasks/{task_id}/cancel"):
        return [base]
    if route.startswith(("/models/{name}/", "/engine/")):  # operators' calls, without a body
        return [base]
    references = [{"previous_response_id": alice.response_id}, {"conversation": CONVERSATION}]
    if route in ("/responses", "/responses/input_tokens"):
        return [Call("POST", url, quick | ref, names_alices=True) for ref in references]
    if route == "/tasks":
        return [
            Call("POST", url, {"type": "response", "input": quick | ref}, names_alices=True)
            for ref in [*references, {"previous_response_id": alice.task_response_id}]
        ]
    if route == "/responses/compact":
        return [Call("POST", url, {"input": "Hello", "max_output_tokens": 2})]
    if route == "/chat/completions":
        return [Call("POST", url, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})]
    if route in ("/messages", "/messages/count_tokens"):  # nothing stored to name (seals: test_messages_api.py)
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hello"}]}
        return [Call("POST", url, body | ({"max_tokens": 2} if route == "/messages" else {}))]
    raise LookupError(f"request body of POST {path}")


@pytest.fixture(scope="module")
def client(
    host: Host, tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny: ResolvedModel
) -> Iterator[TestClient]:
    config = tiny_config(tiny, model_cache, tmp_path_factory.mktemp("tenancy"), ENGINE, tokens=TOKENS)
    with host.serve(config) as c:
        yield c


def _as(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


def _settled(client: TestClient, url: str) -> dict[str, Any]:
    def body() -> dict[str, Any]:
        return dict(client.get(url, headers=_as("alice")).json())

    def settled() -> dict[str, Any] | None:
        found = body()
        return found if found["status"] not in ("queued", "loading", "running", "in_progress", "cancelling") else None

    return wait_until(settled, lambda: f"{url} to settle: {body()}")


@pytest.fixture(scope="module")
def alice(client: TestClient) -> Alice:
    quick = {"input": SECRET, "max_output_tokens": 2, "temperature": 0}
    task = client.post("/lmsp/v1/tasks", json={"type": "response", "input": quick}, headers=_as("alice"))
    assert task.status_code == 202, task.text
    background = client.post("/v1/responses", json=quick | {"background": True}, headers=_as("alice"))
    assert background.status_code == 200, background.text
    turn = client.post("/v1/responses", json=quick | {"conversation": CONVERSATION}, headers=_as("alice"))
    assert turn.status_code == 200, turn.text
    found = Alice(task.json()["id"], task.json()["response_id"], background.json()["id"])
    assert _settled(client, f"/lmsp/v1/tasks/{found.task_id}")["status"] == "succeeded"
    assert _settled(client, f"/v1/responses/{found.response_id}")["status"] in ("completed", "incomplete")
    return found


def _send(client: TestClient, call: Call, auth: dict[str, str]) -> Any:
    return client.request(call.method, call.url, json=call.body, headers=call.headers | auth)


def _error_shape(path: str, r: Any) -> None:
    if _surface_path(path).startswith("/messages"):  # Anthropic's envelope (docs/messages.md)
        assert r.headers["content-type"] == "application/json", r.headers
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}, r.text
    elif path.startswith(("/v1/", "/responses", "/chat/")):
        assert r.headers["content-type"] == "application/json", r.headers
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    else:
        assert r.headers["content-type"] == "application/problem+json", r.headers
        assert r.json()["type"] == f"urn:lmsp:problem:{r.json()['code']}", r.text
        assert r.json()["status"] == r.status_code


def _no_leak(r: Any, alice: Alice, call: Call) -> None:
    """Nothing of Alice's in the answer but what the request itself said (an id echoed back)."""
    sent = json.dumps([call.url, call.body, call.headers])
    for mark in alice.marks():
        # A mark standing alone: "7741" inside a number (a metric's 0.77415 or 7741.0) is not the code.
        if mark not in sent and re.search(rf"(?<![\w.]){re.escape(mark)}(?!\.?\d)", r.text):
            raise AssertionError(f"{call.method} {call.url} {call.body} showed {mark!r}: {r.text[:300]}")


def _normalized(r: Any, ids: list[str]) -> Any:
    text = r.text
    for old in ids:
        text = text.replace(old, "<id>")
    return json.loads(text) if r.headers.get("content-type", "").endswith("json") else text


@pytest.mark.parametrize(("path", "method"), ROUTE_LIST, ids=[f"{m.upper()} {p}" for p, m in ROUTE_LIST])
def test_tenancy(client: TestClient, alice: Alice, path: str, method: str) -> None:
    if (path, method) in PUBLIC:
        assert client.request(method.upper(), path).status_code in (200, 503)  # no token needed
        return
    try:
        tries = calls(path, method, alice)
    except LookupError as exc:
        pytest.fail(f"{method.upper()} {path} is neither in the tenancy matrix nor in PUBLIC: teach calls() its {exc}")
    for call in tries:
        what = f"{call.method} {call.url} {call.body or ''} {call.headers or ''}"
        wrong = (
            {"Authorization": "Bearer not-a-token"},
            {"Authorization": TOKENS["alice"]},
            {"x-api-key": "not-a-token"},
        )
        for auth in ({}, *wrong):
            r = _send(client, call, auth)
            assert r.status_code == 401, f"{what} with {auth or 'no token'}: {r.status_code} {r.text[:200]}"
            assert r.headers["www-authenticate"] == "Bearer"
            _error_shape(path, r)
            _no_leak(r, alice, call)
        conversation = CONVERSATION
        if CONVERSATION in json.dumps(call.body):  # a conversation of Alice's that Bob has never written to
            conversation = _fresh_conversation(client)
            call = call.replace(CONVERSATION, conversation)
        theirs = _send(client, call, _as("bob"))
        _no_leak(theirs, alice, call)
        if not call.names_alices:  # Bob's own request: whatever it answers, nothing of Alice's in it
            assert theirs.status_code < 500, f"{what}: {theirs.status_code} {theirs.text[:200]}"
            continue
        # Bob learns nothing he would not learn from an id that does not exist.
        other = call.elsewhere(alice, conversation)
        nowhere = _send(client, other, _as("bob"))
        assert theirs.status_code == nowhere.status_code, f"{what}: {theirs.text[:200]} vs {nowhere.text[:200]}"
        if theirs.status_code >= 400:
            _error_shape(path, theirs)
            ids = [alice.task_id, alice.response_id, alice.task_response_id, conversation, *other.stands_for]
            assert _normalized(theirs, ids) == _normalized(nowhere, ids), what
        elif path.endswith("/input_tokens"):
            assert theirs.json() == nowhere.json(), f"{what}: Bob's count includes Alice's conversation"
        elif "usage" in theirs.json():  # a response Bob made in a conversation named like Alice's
            counted = theirs.json()["usage"]["input_tokens"]
            assert counted == nowhere.json()["usage"]["input_tokens"], f"{what}: Bob's prompt includes Alice's turns"
        if "{" in path:
            assert theirs.status_code == 404, f"{what}: {theirs.status_code}"


def _fresh_conversation(client: TestClient) -> str:
    name = f"conv_{ulid.new()}"
    turn = {"input": SECRET, "max_output_tokens": 2, "temperature": 0, "conversation": name}
    assert client.post("/v1/responses", json=turn, headers=_as("alice")).status_code == 200
    return name


def test_alice_keeps_what_is_hers(client: TestClient, alice: Alice) -> None:
    """After the matrix (Bob's cancels and deletes included), Alice's things are as she left them."""
    task = client.get(f"/lmsp/v1/tasks/{alice.task_id}", headers=_as("alice")).json()
    assert task["status"] == "succeeded"
    assert client.get(f"/v1/responses/{alice.task_response_id}", headers=_as("alice")).status_code == 200
    response = client.get(f"/v1/responses/{alice.response_id}", headers=_as("alice")).json()
    assert response["status"] in ("completed", "incomplete")
    items = client.get(f"/v1/responses/{alice.response_id}/input_items", headers=_as("alice")).json()
    assert SECRET in json.dumps(items)
    listed = client.get("/lmsp/v1/tasks?limit=100", headers=_as("alice")).json()
    assert alice.task_id in [t["id"] for t in listed["data"]]
    events = client.get(f"/lmsp/v1/tasks/{alice.task_id}/events", headers=_as("alice"))
    assert events.status_code == 200 and "event: response.incomplete" in events.text
    counted = client.post(
        "/v1/responses/input_tokens", json={"input": "Hi", "conversation": CONVERSATION}, headers=_as("alice")
    ).json()["input_tokens"]
    alone = client.post("/v1/responses/input_tokens", json={"input": "Hi"}, headers=_as("alice")).json()
    assert counted > alone["input_tokens"], "Alice's conversation lost its transcript"


def test_server_wide_figures_are_for_operators_alone(client: TestClient, alice: Alice) -> None:
    """``/metrics`` counts every tenant's tasks (``lmspd_tasks{status}``): an ordinary token, Alice's
    own included, is refused, so Bob never reads the size of her queue there
    (docs/operations.md, "Metrics and logs")."""
    for who in ("alice", "bob"):
        r = client.get("/metrics", headers=_as(who))
        assert r.status_code == 403, f"{who}: {r.status_code} {r.text[:200]}"
        _error_shape("/metrics", r)
        assert r.json()["code"] == "forbidden" and "lmspd_tasks" not in r.text
