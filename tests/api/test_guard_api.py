"""The guard against web pages (lmspd.api.guard; docs/operations.md, "Security"), generated
from the app's own routes as the tenancy matrix is: every route × {a rebound Host, a foreign
Origin, a body that is not JSON}, each refused in its surface's error shape with nothing
written; and what real clients send (no Origin, the console's own origin, an allowed app's)
still served. The real browser's view of the same attacks is tests/browser/test_cross_origin.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from lmspd.api.app import ROUTES
from lmspd.api.openapi import documented
from lmspd.api.problems import is_anthropic_path
from lmspd.config import EngineConfig
from lmspd.models.registry import ResolvedModel

ENGINE = EngineConfig(weight_dtype="quantized")
APP = "https://app.example:8443"
ROUTE_LIST = documented(ROUTES)
WRITES = [(path, method) for path, method in ROUTE_LIST if method != "get"]
QUICK = {"input": "Hello.", "max_output_tokens": 2}


def _concrete(path: str) -> str:
    """Any value for a path's parameters: the guard answers before a route looks them up."""
    return re.sub(r"\{[^}]+\}", "x1", path)


def _is_openai(path: str) -> bool:
    return path.startswith(("/v1/", "/responses", "/chat/"))


def _assert_refused(r: Any, path: str, status: int, code: str, param: str) -> None:
    """``r``: the TestClient's response (httpx2's, not the httpx the SDKs use)."""
    assert r.status_code == status, (path, r.status_code, r.text)
    body = r.json()
    if is_anthropic_path(path):  # Anthropic's envelope has no code or param: the message names it
        assert r.headers["content-type"] == "application/json"
        assert body["type"] == "error" and param.lower() in body["error"]["message"].lower()
        assert body["error"]["type"] == ("permission_error" if status == 403 else "invalid_request_error")
    elif _is_openai(path):
        assert r.headers["content-type"] == "application/json"
        assert body["error"]["code"] == code and body["error"]["param"] == param
    else:
        assert r.headers["content-type"] == "application/problem+json"
        assert body["code"] == code and body["param"] == param and body["status"] == status
    assert "access-control-allow-origin" not in r.headers


@pytest.fixture(scope="module")
def client(
    host: Host, tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny: ResolvedModel
) -> Iterator[TestClient]:
    data = tmp_path_factory.mktemp("guard")
    config = tiny_config(
        tiny, model_cache, data, ENGINE, allowed_hosts=["lmspd.example", ".lan.example"], allowed_origins=[APP]
    )
    with host.serve(config) as c:
        yield c


def _task_count(client: TestClient) -> int:
    r = client.get("/lmsp/v1/summary")
    assert r.status_code == 200, r.text
    return sum(r.json()["tasks"].values())


@pytest.mark.parametrize(("path", "method"), ROUTE_LIST, ids=[f"{m} {p}" for p, m in ROUTE_LIST])
def test_a_rebound_host_is_refused_on_every_route(client: TestClient, path: str, method: str) -> None:
    for host in ("rebind.test:8080", "evil.example", "127.0.0.1.evil.example", "lmspd.example.evil"):
        r = client.request(
            method.upper(), _concrete(path), headers={"Host": host}, json=QUICK if method != "get" else None
        )
        _assert_refused(r, path, 421, "misdirected_request", "Host")


@pytest.mark.parametrize(("path", "method"), WRITES, ids=[f"{m} {p}" for p, m in WRITES])
def test_a_foreign_origin_may_not_write(client: TestClient, path: str, method: str) -> None:
    before = _task_count(client)
    for origin in ("http://evil.example", "null", "http://127.0.0.1:9", "https://127.0.0.1"):
        r = client.request(method.upper(), _concrete(path), headers={"Origin": origin}, json=QUICK)
        _assert_refused(r, path, 403, "forbidden_origin", "Origin")
        preflight = client.options(
            _concrete(path), headers={"Origin": origin, "Access-Control-Request-Method": method.upper()}
        )
        _assert_refused(preflight, path, 403, "forbidden_origin", "Origin")
    assert _task_count(client) == before


@pytest.mark.parametrize(("path", "method"), WRITES, ids=[f"{m} {p}" for p, m in WRITES])
def test_a_body_must_declare_json(client: TestClient, path: str, method: str) -> None:
    """A form or text body (what a page may send without a preflight), and a body that declares
    nothing (a ``no-cors`` Blob), are refused however they reach the server."""
    before = _task_count(client)
    body = b'{"input": "Hello.", "max_output_tokens": 2}'
    for headers in (
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "multipart/form-data; boundary=x"},
        {},
    ):
        r = client.request(method.upper(), _concrete(path), headers=headers, content=body)
        code = "unsupported_content_type" if _is_openai(path) else "invalid_request"
        _assert_refused(r, path, 415, code, "Content-Type")
    assert _task_count(client) == before


def test_a_foreign_origin_reads_without_a_grant(client: TestClient) -> None:
    r = client.get("/lmsp/v1/tasks", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_what_real_clients_send_is_served(client: TestClient) -> None:
    """SDKs, agents and curl send no Origin; the console sends its own; IPv6 loopback, the
    names in allowed_hosts and localhost's subdomains are this server's names too."""
    before = _task_count(client)
    hosts = ["127.0.0.1:8080", "localhost", "LOCALHOST.:8080", "[::1]:8080", "lmspd.example", "a.lan.example:1"]
    for host in hosts:
        r = client.post("/v1/responses", headers={"Host": host}, json=QUICK)
        assert r.status_code == 200, (host, r.text)
    own = client.post(
        "/v1/responses", headers={"Host": "localhost:8080", "Origin": "http://localhost:8080"}, json=QUICK
    )
    assert own.status_code == 200, own.text
    cancel = client.post("/lmsp/v1/tasks/task_00000000000000000000000000/cancel")  # no body, no type: fine
    assert cancel.status_code == 404, cancel.text
    assert _task_count(client) == before + len(hosts) + 1


def test_an_allowed_origin_gets_cors(client: TestClient) -> None:
    preflight = client.options(
        "/lmsp/v1/tasks",
        headers={
            "Origin": APP,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, idempotency-key",
        },
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == APP
    assert "idempotency-key" in preflight.headers["access-control-allow-headers"].lower()
    made = client.post("/lmsp/v1/tasks", headers={"Origin": APP}, json={"type": "response", "input": QUICK})
    assert made.status_code == 202, made.text
    assert made.headers["access-control-allow-origin"] == APP
    assert "location" in made.headers["access-control-expose-headers"].lower()
