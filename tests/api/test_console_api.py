"""The console's server side on the real app: its page and assets from package data (CSP,
nosniff, ETag and 304, no token needed) and ``GET /lmsp/v1/summary`` (docs/console.md): the
caller's own task counts, the models' state, the engine and the recent speed, which moves by
the generations run. The page itself is tested in a real browser (tests/browser)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from harness.wait import wait_until
from lmspd import __version__
from lmspd.api.console import ASSETS, CSP
from lmspd.config import EngineConfig
from lmspd.models.registry import ResolvedModel
from lmspd.store.status import STATUSES

ENGINE = EngineConfig(weight_dtype="quantized")
TOKENS = {"alice": "console-alice-token", "bob": "console-bob-token"}
ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}


@pytest.fixture(scope="module")
def client(
    host: Host, tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel
) -> Iterator[TestClient]:
    # tiny_long: a generation long enough to be seen running (its context holds 3000 tokens).
    config = tiny_config(tiny_long, model_cache, tmp_path_factory.mktemp("console") / "data", ENGINE, tokens=TOKENS)
    with host.serve(config) as c:
        yield c


def summary(client: TestClient, headers: dict[str, str]) -> dict[str, Any]:
    r = client.get("/lmsp/v1/summary", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    body: dict[str, Any] = r.json()
    return body


def finished_task(client: TestClient, headers: dict[str, str], tokens: int) -> str:
    body = {"type": "response", "input": {"input": "Hello", "temperature": 0, "max_output_tokens": tokens}}
    r = client.post("/lmsp/v1/tasks", json=body, headers=headers)
    assert r.status_code == 202, r.text
    task_id: str = r.json()["id"]

    def done() -> bool:
        return bool(client.get(f"/lmsp/v1/tasks/{task_id}", headers=headers).json()["status"] == "succeeded")

    wait_until(done, f"{task_id} to succeed", timeout=60)
    return task_id


@pytest.mark.parametrize("path", ["/", *(f"/console/{name}" for name in ASSETS if name != "index.html")])
def test_the_page_and_its_assets_need_no_token_and_carry_the_policy(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 200, r.text
    assert r.headers["content-security-policy"] == CSP
    assert "default-src 'self'" in CSP and "unsafe-inline" not in CSP and "http" not in CSP
    assert r.headers["x-content-type-options"] == "nosniff"
    name = "index.html" if path == "/" else path.rpartition("/")[2]
    assert r.content == ASSETS[name].body
    assert r.headers["content-type"] == ASSETS[name].media
    tag = r.headers["etag"]
    again = client.get(path, headers={"If-None-Match": tag})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == tag
    assert again.headers["content-security-policy"] == CSP
    changed = client.get(path, headers={"If-None-Match": '"something-else"'})
    assert changed.status_code == 200 and changed.content == r.content


def test_the_page_loads_only_its_own_assets() -> None:
    """Every script, stylesheet and import the page names is one of its assets (no CDN)."""
    import re

    texts = {name: asset.body.decode() for name, asset in ASSETS.items()}
    named = set(re.findall(r'(?:src|href)="/console/([^"]+)"', texts["index.html"]))
    for name, text in texts.items():
        if name.endswith(".js"):
            named |= set(re.findall(r'from "\./([^"]+)"', text))
            assert ".innerHTML" not in text, name  # text only: nothing a model says becomes markup
    assert named and named <= set(ASSETS), named - set(ASSETS)
    assert not re.search(r"https?://", "".join(t for n, t in texts.items() if n != "icon.svg"))
    assert "<script>" not in texts["index.html"] and " style=" not in texts["index.html"]


def test_an_unknown_asset_is_a_problem_object(client: TestClient) -> None:
    r = client.get("/console/nope.js")
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"


def test_the_summary_needs_a_token(client: TestClient) -> None:
    r = client.get("/lmsp/v1/summary")
    assert r.status_code == 401 and r.headers["content-type"] == "application/problem+json"
    assert client.get("/lmsp/v1/summary", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_the_summary_counts_only_the_callers_tasks_and_the_speed_moves(client: TestClient) -> None:
    before_alice, before_bob = summary(client, ALICE), summary(client, BOB)
    assert before_alice["object"] == "summary" and before_alice["version"] == __version__
    assert set(before_alice["tasks"]) == set(STATUSES)
    assert before_alice["ready"] is True and before_alice["engine"]["state"] == "up"
    assert before_alice["engine"]["rss_bytes"] > 0 and before_alice["engine"]["pid"] > 0
    generations = before_alice["speed"]["generations"]

    finished_task(client, ALICE, tokens=12)
    finished_task(client, ALICE, tokens=12)
    alice, bob = summary(client, ALICE), summary(client, BOB)
    assert alice["tasks"]["succeeded"] == before_alice["tasks"]["succeeded"] + 2
    assert bob["tasks"] == before_bob["tasks"]  # Bob never learns the size of Alice's queue
    # Speed is the server's (whoever ran the generations): both see the same figures.
    assert alice["speed"]["generations"] == min(generations + 2, 32) == bob["speed"]["generations"]
    assert alice["speed"]["ttft_ms"] > 0 and alice["speed"]["tokens_per_sec"] > 0
    (tiny,) = [m for m in alice["models"] if m["id"] == "tiny"]
    assert tiny["loaded"] is True and tiny["resident_bytes"] > 0
    assert abs(alice["now"] - before_alice["now"]) < 3600  # the server's clock, in unix seconds


def generating(client: TestClient, task_id: str, headers: dict[str, str]) -> None:
    """Return once the task's first token is in its event log (read from its event stream)."""
    with client.stream("GET", f"/lmsp/v1/tasks/{task_id}/events", headers=headers) as r:
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                return
    raise AssertionError(f"{task_id} ended without generating")


def test_the_engines_in_flight_is_the_callers_own(client: TestClient) -> None:
    """Alice's generation runs on the engine: her summary counts it, Bob's does not (a count of
    everyone's would let him watch her queue drain; docs/console.md)."""
    body = {"type": "response", "input": {"input": "Tell me a story.", "temperature": 0, "max_output_tokens": 3000}}
    r = client.post("/lmsp/v1/tasks", json=body, headers=ALICE)
    assert r.status_code == 202, r.text
    task_id = r.json()["id"]
    try:
        generating(client, task_id, ALICE)
        alice, bob = summary(client, ALICE), summary(client, BOB)
        assert alice["tasks"]["running"] == 1 and alice["engine"]["in_flight"] == 1
        assert bob["tasks"]["running"] == 0 and bob["engine"]["in_flight"] == 0, bob
        assert bob["engine"]["state"] == "up" and bob["engine"]["pid"] == alice["engine"]["pid"]  # the server's
    finally:
        client.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=ALICE)

        def cancelled() -> bool:
            return bool(client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json()["status"] == "cancelled")

        wait_until(cancelled, f"{task_id} to be cancelled")


def test_the_openapi_document_has_the_summary_and_the_console(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    op = doc["paths"]["/lmsp/v1/summary"]["get"]
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Summary"}
    assert op["security"] == [{"bearer": []}, {"apiKey": []}, {}]  # x-api-key: the same token
    scrape = doc["paths"]["/metrics"]["get"]
    assert "403" in scrape["responses"] and "401" in scrape["responses"]  # operators alone
    page = doc["paths"]["/"]["get"]
    assert page["security"] == [] and "text/html" in page["responses"]["200"]["content"]
    assert "304" in page["responses"]
