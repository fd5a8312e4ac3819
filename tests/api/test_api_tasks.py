"""LMSP task endpoints on the real app (TestClient), real SQLite file, real engine, tiny model."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from harness.engine_host import Host, purge, tiny_config
from harness.openresponses import validate, validate_event
from harness.wait import wait_until
from lmspd.api import events
from lmspd.config import Config, EngineConfig
from lmspd.models.registry import ResolvedModel

TOKENS = {"alice": "alice-secret-token", "bob": "bob-secret-token"}
ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}
OPS = {"Authorization": "Bearer ops-secret-token"}  # an operator's: /metrics is server-wide


def task_body(text: str = "Tell me a story.", **extra: Any) -> dict[str, Any]:
    return {"type": "response", "input": {"input": text, "temperature": 0, "max_output_tokens": 16, **extra}}


ENGINE = EngineConfig(weight_dtype="quantized")


@pytest.fixture
def server_config(tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel) -> Config:
    return tiny_config(
        tiny_long,
        model_cache,
        tmp_path / "data",
        ENGINE,
        tokens=TOKENS,
        admin_tokens={"ops": "ops-secret-token"},
        max_body_bytes=64 * 1024,
        keepalive_secs=0.5,
    )


@pytest.fixture
def client(host: Host, server_config: Config) -> Iterator[TestClient]:
    with host.serve(server_config) as c:
        yield c


def db_rows(config: Config, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(config.server.database_path) as conn:
        return conn.execute(sql).fetchall()


def wait_done(client: TestClient, task_id: str, timeout: float = 60) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        task: dict[str, Any] = client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json()
        return task if task["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_until(done, f"task {task_id} to finish", timeout=timeout)


def wait_running(client: TestClient, task_id: str) -> None:
    def running() -> bool:
        return bool(client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json()["status"] == "running")

    wait_until(running, f"task {task_id} to run")


def sse(
    client: TestClient, task_id: str, headers: dict[str, str] | None = None, query: str = ""
) -> list[dict[str, Any]]:
    """Read a whole event stream; returns events with their SSE id attached."""
    events: list[dict[str, Any]] = []
    with client.stream("GET", f"/lmsp/v1/tasks/{task_id}/events{query}", headers={**ALICE, **(headers or {})}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        block: dict[str, str] = {}
        for line in r.iter_lines():
            if line.startswith(("id: ", "event: ", "data: ")):
                key, _, value = line.partition(": ")
                block[key] = value
            elif line == "" and "data" in block:
                event = msgspec.json.decode(block["data"])
                assert int(block["id"]) == event["sequence_number"] and block["event"] == event["type"]
                events.append(event)
                block = {}
    return events


def test_create_persists_before_answering_and_runs_to_completion(client: TestClient, server_config: Config) -> None:
    r = client.post("/lmsp/v1/tasks", json=task_body(), headers=ALICE)
    assert r.status_code == 202
    task = r.json()
    assert task["status"] in ("queued", "loading", "running") and task["object"] == "task"
    assert task["events_url"] == f"/lmsp/v1/tasks/{task['id']}/events"
    # Committed before the 202: another connection sees the task and its response.created.
    assert db_rows(server_config, f"SELECT seq, type FROM events WHERE task_id = '{task['id']}' AND seq = 0") == [
        (0, "response.created")
    ]
    done = wait_done(client, task["id"])
    assert done["status"] == "succeeded" and done["error"] is None
    validate("ResponseResource", done["response"])
    assert done["response"]["id"] == task["response_id"]
    assert done["response"]["status"] == "incomplete"  # 16 tokens: the limit, which is still a success
    assert done["response"]["usage"]["output_tokens"] == 16
    events = sse(client, task["id"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        validate_event(e)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == done["response"]["output"][0]["content"][0]["text"]
    assert events[-1]["type"] == "response.incomplete"


def test_sse_replay_from_every_last_event_id(client: TestClient) -> None:
    task_id = client.post("/lmsp/v1/tasks", json=task_body(), headers=ALICE).json()["id"]
    wait_done(client, task_id)
    full = sse(client, task_id)
    for n in range(-1, len(full) - 1):
        assert sse(client, task_id, {"Last-Event-ID": str(n)}) == full[n + 1 :]
    assert sse(client, task_id, query="?after=3") == full[4:]
    assert sse(client, task_id, {"Last-Event-ID": "5"}, query="?after=1") == full[6:]  # the header wins


@pytest.mark.parametrize("value", ["abc", "1.5", "999999", "-2"])
def test_invalid_last_event_id(client: TestClient, value: str) -> None:
    task_id = client.post("/lmsp/v1/tasks", json=task_body(), headers=ALICE).json()["id"]
    r = client.get(f"/lmsp/v1/tasks/{task_id}/events", headers={**ALICE, "Last-Event-ID": value})
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "invalid_request" and r.json()["param"] == "Last-Event-ID"


def test_events_past_retention_are_gone(client: TestClient) -> None:
    task_id = client.post("/lmsp/v1/tasks", json=task_body(), headers=ALICE).json()["id"]
    wait_done(client, task_id)
    purge(client, events_older_than=1)
    r = client.get(f"/lmsp/v1/tasks/{task_id}/events", headers=ALICE)
    assert r.status_code == 410 and r.json()["code"] == "event_history_expired"
    assert client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).status_code == 200


def test_etag_and_if_none_match(client: TestClient) -> None:
    task_id = client.post("/lmsp/v1/tasks", json=task_body(), headers=ALICE).json()["id"]
    wait_done(client, task_id)
    r = client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE)
    tag = r.headers["etag"]
    again = client.get(f"/lmsp/v1/tasks/{task_id}", headers={**ALICE, "If-None-Match": tag})
    assert again.status_code == 304 and again.content == b""


def test_cancel_running_then_idempotent_then_409_for_finished(client: TestClient) -> None:
    task_id = client.post("/lmsp/v1/tasks", json=task_body(max_output_tokens=3000), headers=ALICE).json()["id"]
    wait_running(client, task_id)
    r = client.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=ALICE)
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
    assert wait_done(client, task_id)["status"] == "cancelled"
    again = client.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=ALICE)
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    events = sse(client, task_id)
    assert events[-1]["type"] == "response.cancelled"
    validate_event(events[-1])

    done_id = client.post("/lmsp/v1/tasks", json=task_body(), headers=ALICE).json()["id"]
    wait_done(client, done_id)
    r = client.post(f"/lmsp/v1/tasks/{done_id}/cancel", headers=ALICE)
    assert r.status_code == 409 and r.json()["code"] == "task_not_cancelable"
    r = client.post("/lmsp/v1/tasks/task_nope/cancel", headers=ALICE)
    assert r.status_code == 404 and r.json()["code"] == "task_not_found"


def test_other_tokens_cannot_see_a_task(client: TestClient) -> None:
    task_id = client.post("/lmsp/v1/tasks", json=task_body(), headers=ALICE).json()["id"]
    for method, path in [("GET", ""), ("POST", "/cancel"), ("GET", "/events")]:
        r = client.request(method, f"/lmsp/v1/tasks/{task_id}{path}", headers=BOB)
        assert r.status_code == 404 and r.json()["code"] == "task_not_found"
    assert client.get("/lmsp/v1/tasks", headers=BOB).json()["data"] == []


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}])
def test_missing_or_wrong_token(client: TestClient, server_config: Config, headers: dict[str, str]) -> None:
    r = client.post("/lmsp/v1/tasks", json=task_body(), headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["type"] == "urn:lmsp:problem:unauthorized"
    assert client.get("/lmsp/v1/tasks", headers=headers).status_code == 401
    assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
    assert db_rows(server_config, "SELECT count(*) FROM tasks") == [(0,)]


def test_list_filters_and_pages(client: TestClient) -> None:
    ids = [client.post("/lmsp/v1/tasks", json=task_body(), headers=ALICE).json()["id"] for _ in range(5)]
    for i in ids:
        wait_done(client, i)
    page = client.get("/lmsp/v1/tasks?limit=2", headers=ALICE).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [t["id"] for t in page["data"]] == ids[::-1][:2]
    assert (page["first_id"], page["last_id"]) == (ids[-1], ids[-2])
    rest = client.get(f"/lmsp/v1/tasks?limit=10&after={page['last_id']}", headers=ALICE).json()
    assert [t["id"] for t in rest["data"]] == ids[::-1][2:] and rest["has_more"] is False
    assert len(client.get("/lmsp/v1/tasks?status=succeeded&status=failed", headers=ALICE).json()["data"]) == 5
    assert client.get("/lmsp/v1/tasks?status=queued", headers=ALICE).json()["data"] == []
    for bad in ["limit=0", "limit=101", "limit=x", "status=done"]:
        r = client.get(f"/lmsp/v1/tasks?{bad}", headers=ALICE)
        assert r.status_code == 400 and r.json()["param"] == bad.split("=")[0]


def test_idempotency_key_concurrent_duplicates_make_one_task(client: TestClient, server_config: Config) -> None:
    headers = {**ALICE, "Idempotency-Key": "job-42"}
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda _: client.post("/lmsp/v1/tasks", json=task_body(), headers=headers), range(20)))
    assert {r.status_code for r in results} == {202}
    assert len({r.json()["id"] for r in results}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in results) == 19
    assert db_rows(server_config, "SELECT count(*) FROM tasks") == [(1,)]
    r = client.post("/lmsp/v1/tasks", json=task_body("Another text"), headers=headers)
    assert r.status_code == 422 and r.json()["code"] == "idempotency_key_reused"
    # Scoped per token: Bob's same key is his own task.
    assert (
        client.post("/lmsp/v1/tasks", json=task_body(), headers={**BOB, "Idempotency-Key": "job-42"}).json()["id"]
        != results[0].json()["id"]
    )


def test_a_request_cannot_make_the_server_read_a_path(
    client: TestClient, server_config: Config, tiny_long: ResolvedModel
) -> None:
    """A real model directory, named by a client: refused unless [server] allow_model_paths."""
    task = {"type": "response", "input": {"input": "hi", "model": str(tiny_long.path)}}
    r = client.post("/lmsp/v1/tasks", json=task, headers=ALICE)
    assert r.status_code == 404, r.text
    assert r.json()["param"] == "model" and "allow_model_paths" in r.json()["detail"]
    r = client.post("/v1/responses", json={"model": str(tiny_long.path), "input": "hi"}, headers=ALICE)
    assert (r.status_code, r.json()["error"]["param"]) == (404, "model")
    r = client.post("/v1/responses/input_tokens", json={"model": str(tiny_long.path), "input": "hi"}, headers=ALICE)
    assert r.status_code == 404
    assert db_rows(server_config, "SELECT count(*) FROM tasks") == [(0,)]


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_request", None),
        (b'{"type": "response", "input": {"input": 5}}', 400, "invalid_request", "input.input"),
        (
            b'{"type": "response", "input": {"input": "hi", "max_output_tokens": "many"}}',
            400,
            "invalid_request",
            "input.max_output_tokens",
        ),
        (b'{"type": "response", "input": {"input": "hi", "tools_x": []}}', 400, "invalid_request", "input.tools_x"),
        (
            b'{"type": "response", "input": {"input": "hi", "tools": [{"type": "web_search"}]}}',
            400,
            "invalid_request",
            "input.tools[0].type",
        ),
        (b'{"type": "response", "input": {"input": "hi"}, "priority": 1}', 400, "invalid_request", "priority"),
        (b'{"type": "batch", "input": {"input": "hi"}}', 400, "invalid_request", "type"),
        (
            b'{"type": "response", "input": {"input": "hi"}, "on_restart": "never"}',
            400,
            "invalid_request",
            "on_restart",
        ),
        (b'{"type": "response", "input": {"input": "hi", "temperature": 5}}', 400, "invalid_request", "temperature"),
        (b'{"type": "response", "input": {"input": "hi", "model": "ghost"}}', 404, "model_not_found", "model"),
        (
            b'{"type": "response", "input": {"input": "' + b"word " * 5000 + b'"}}',
            400,
            "context_length_exceeded",
            "input",
        ),
        (b'{"type": "response", "input": {"input": "' + b"x" * 70000 + b'"}}', 413, "payload_too_large", None),
    ],
)
def test_bad_input_is_a_problem_and_persists_nothing(
    client: TestClient, server_config: Config, body: bytes, status: int, code: str, param: str | None
) -> None:
    r = client.post("/lmsp/v1/tasks", content=body, headers={**ALICE, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert (problem["code"], problem.get("param"), problem["status"]) == (code, param, status)
    assert problem["type"] == f"urn:lmsp:problem:{code}" and problem["title"] and problem["detail"]
    assert db_rows(server_config, "SELECT count(*) FROM tasks") == [(0,)]


@pytest.mark.parametrize("key", [b"", b"x" * 256, "caf\u00e9".encode("latin-1"), b"tab\there", b"del\x7f"])
def test_invalid_idempotency_key(client: TestClient, server_config: Config, key: bytes) -> None:
    headers = {b"Authorization": ALICE["Authorization"].encode(), b"Idempotency-Key": key}
    r = client.post("/lmsp/v1/tasks", json=task_body(), headers=headers)
    assert r.status_code == 400 and r.json()["param"] == "Idempotency-Key"
    assert db_rows(server_config, "SELECT count(*) FROM tasks") == [(0,)]


def test_unknown_task_and_route(client: TestClient) -> None:
    r = client.get("/lmsp/v1/tasks/task_nope", headers=ALICE)
    assert r.status_code == 404 and r.json()["code"] == "task_not_found"
    assert client.get("/lmsp/v1/nothing", headers=ALICE).json()["code"] == "not_found"


def test_discovery(client: TestClient) -> None:
    caps = client.get("/lmsp/v1/capabilities", headers=ALICE).json()
    assert caps["lmsp_version"] == "1.0" and caps["capabilities"]["resume_snapshots"] is True
    assert caps["on_restart"] == ["fail", "retry", "resume"] and caps["task_types"] == ["response"]
    names = [m["id"] for m in client.get("/lmsp/v1/models", headers=ALICE).json()["data"]]
    assert "tiny" in names and "smollm2-135m-instruct" in names


FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


def settle_and_check(client: TestClient, task_id: str, cancel_status: int) -> str:
    """A cancelled-or-finished task's invariants, whichever won; returns its final status."""
    task = wait_done(client, task_id)
    # The cancel's answer decides the outcome: 200 (cancelling/cancelled) can only end
    # cancelled, 409 means it had already succeeded.
    assert task["status"] == {200: "cancelled", 409: "succeeded"}[cancel_status], task
    events = sse(client, task_id)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # no gap, no duplicate
    finals = [e["type"] for e in events if e["type"] in FINAL_EVENTS]
    expected = {"succeeded": ("response.completed", "response.incomplete"), "cancelled": ("response.cancelled",)}
    assert len(finals) == 1 and finals[0] in expected[task["status"]] and events[-1]["type"] == finals[0]
    # A terminal state never changes: cancelling again answers from it and moves nothing.
    again = client.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=ALICE)
    if task["status"] == "cancelled":
        assert again.status_code == 200 and again.json()["status"] == "cancelled"
    else:
        assert again.status_code == 409 and again.json()["code"] == "task_not_cancelable"
    after = client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json()
    assert after["status"] == task["status"] and sse(client, task_id) == events
    return str(task["status"])


def test_cancel_racing_completion(client: TestClient) -> None:
    quick = {"type": "response", "input": {"input": "Hi", "temperature": 0, "max_output_tokens": 2}}

    # Racing: cancel right after create, at different points (queued, loading, running, done).
    # Which side wins depends on the machine; the invariants hold either way.
    # Four clients race side by side (each cancel still follows its own create by the
    # given delay), which also puts some of the tasks behind others in the queue.
    def race(i: int) -> tuple[str, int]:
        task_id = client.post("/lmsp/v1/tasks", json=quick, headers=ALICE).json()["id"]
        time.sleep((i % 10) * 0.002)
        r = client.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=ALICE)
        assert r.status_code in (200, 409), r.text
        return task_id, r.status_code

    with ThreadPoolExecutor(4) as pool:
        racing = list(pool.map(race, range(100)))
    # Both outcomes by construction: a long task cancelled once running (cancel wins) ...
    long_body = task_body(max_output_tokens=3000)
    cancelled = []
    for _ in range(3):
        task_id = client.post("/lmsp/v1/tasks", json=long_body, headers=ALICE).json()["id"]
        wait_running(client, task_id)
        r = client.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=ALICE)
        assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
        cancelled.append((task_id, 200))
    # ... and a cancel that arrives after completion (409: completion won).
    succeeded = []
    for _ in range(3):
        task_id = client.post("/lmsp/v1/tasks", json=quick, headers=ALICE).json()["id"]
        assert wait_done(client, task_id)["status"] == "succeeded"
        r = client.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=ALICE)
        assert r.status_code == 409 and r.json()["code"] == "task_not_cancelable"
        succeeded.append((task_id, 409))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda race: settle_and_check(client, *race), racing))
    assert {settle_and_check(client, t, c) for t, c in cancelled} == {"cancelled"}
    assert {settle_and_check(client, t, c) for t, c in succeeded} == {"succeeded"}


# --- /metrics and the request log ----------------------------------------------------------

MetricSamples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
PROMPT = "Tell me a story about the zebra Quagga-4711."


def scrape(client: TestClient) -> MetricSamples:
    r = client.get("/metrics", headers=OPS)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: MetricSamples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def moved(before: MetricSamples, after: MetricSamples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_metrics_move_by_what_the_tasks_did(
    host: Host, server_config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lmspd")
    with host.serve(server_config) as client:
        assert client.get("/metrics").status_code == 401  # tokens are configured: one is required
        assert client.get("/metrics", headers=ALICE).status_code == 403  # and an operator's
        before = scrape(client)
        assert value(before, "lmspd_engine_up") == 1
        body = {"type": "response", "input": {"input": PROMPT, "temperature": 0, "max_output_tokens": 16}}
        created = client.post("/lmsp/v1/tasks", json=body, headers=ALICE)
        assert created.status_code == 202
        task = wait_done(client, created.json()["id"])
        # The same prompt again, on /v1/responses: a second kind, and the prompt cache's turn.
        reply = client.post(
            "/v1/responses", json={"input": PROMPT, "temperature": 0, "max_output_tokens": 8}, headers=ALICE
        ).json()
        with client.stream("GET", f"/lmsp/v1/tasks/{task['id']}/events", headers=ALICE) as stream:
            assert "response.incomplete" in stream.read().decode()
        after = scrape(client)
        streamed = {"input": PROMPT, "temperature": 0, "max_output_tokens": 4, "stream": True}
        with client.stream("POST", "/v1/responses", json=streamed, headers=ALICE) as stream:
            assert "response.output_text.delta" in stream.read().decode()
        last = scrape(client)

    usages = [task["response"]["usage"], reply["usage"]]
    assert task["status"] == "succeeded" and [u["output_tokens"] for u in usages] == [16, 8]
    assert moved(before, after, "lmspd_tasks_created_total", kind="task") == 1
    assert moved(before, after, "lmspd_tasks_created_total", kind="response") == 1
    assert moved(before, after, "lmspd_tasks_finished_total", outcome="succeeded") == 2
    assert moved(before, after, "lmspd_tasks_finished_total", outcome="failed") == 0
    assert moved(before, after, "lmspd_generations_finished_total", reason="length") == 2  # both incomplete
    assert moved(before, after, "lmspd_output_tokens_total") == 24
    assert moved(before, after, "lmspd_prompt_tokens_total") == sum(u["input_tokens"] for u in usages)
    cached = [u["input_tokens_details"]["cached_tokens"] for u in usages]
    assert moved(before, after, "lmspd_prompt_cached_tokens_total") == sum(cached)
    assert moved(before, after, "lmspd_prompt_cache_hits_total") == sum(1 for c in cached if c)
    # One first token per generation; every later token is one latency observation.
    assert moved(before, after, "lmspd_time_to_first_token_seconds_count") == 2
    assert moved(before, after, "lmspd_token_latency_seconds_count") == 15 + 7
    # Every write went through the group commit: at least one job per commit.
    commits = moved(before, after, "lmspd_store_commit_seconds_count")
    assert commits >= 4 and moved(before, after, "lmspd_store_commit_batch_size_count") == commits
    assert moved(before, after, "lmspd_store_commit_batch_size_sum") >= commits
    assert value(after, "lmspd_sse_streams_open", api="lmsp") == 0
    assert value(after, "lmspd_engine_restarts_total") == 0
    # Where the time to first token went: every stage of both generations but the last, which
    # only the stream that submitted a response has.
    for stage in ("intake", "claim", "prompt", "engine", "commit"):
        assert moved(before, after, "lmspd_first_token_stage_seconds_count", stage=stage) == 2
        assert moved(after, last, "lmspd_first_token_stage_seconds_count", stage=stage) == 1
    assert moved(before, after, "lmspd_first_token_stage_seconds_count", stage="deliver") == 0
    assert moved(after, last, "lmspd_first_token_stage_seconds_count", stage="deliver") == 1
    # Read from the database at scrape time.
    assert value(after, "lmspd_tasks", status="succeeded") == 2
    assert value(after, "lmspd_tasks", status="queued") == 0

    # One line per request, with its status, duration and task; no prompt text anywhere.
    access = [r for r in caplog.records if r.name == "lmspd.access"]
    post = next(r for r in access if r.getMessage().startswith("POST /lmsp/v1/tasks 202 "))
    fields: dict[str, Any] = post.__dict__
    assert (fields["method"], fields["path"], fields["status"]) == ("POST", "/lmsp/v1/tasks", 202)
    assert fields["task_id"] == task["id"] and post.getMessage().endswith(f"ms task={task['id']}")
    assert isinstance(fields["ms"], float) and fields["ms"] >= 0
    assert any(r.__dict__.get("status") == 401 and r.__dict__["path"] == "/metrics" for r in access)
    assert all("Quagga" not in r.getMessage() for r in caplog.records)

    # After a restart the counters begin again, while what the database holds is still there.
    with host.serve(server_config) as client:
        again = scrape(client)
    assert value(again, "lmspd_tasks_finished_total", outcome="succeeded") == 0
    assert value(again, "lmspd_tasks", status="succeeded") == 3


def test_open_streams_are_counted_until_they_close(client: TestClient) -> None:
    task = client.post("/lmsp/v1/tasks", json=task_body(max_output_tokens=2), headers=ALICE).json()
    wait_done(client, task["id"])
    core = client.app.state.lmsp.core  # type: ignore[attr-defined]
    stream = events._lmsp_stream(core, task["id"], -1)
    assert client.portal is not None
    assert client.portal.call(stream.__anext__) == b"retry: 2000\n\n"
    assert value(scrape(client), "lmspd_sse_streams_open", api="lmsp") == 1
    client.portal.call(stream.aclose)
    assert value(scrape(client), "lmspd_sse_streams_open", api="lmsp") == 0


def test_the_engine_starts_before_the_claim_lands_and_stops_if_it_fails(client: TestClient) -> None:
    """A resident model's task is claimed while its prompt is prepared and prefilled: the
    generation starts before the claim's commit lands, nothing of the task's is committed
    until it has, and a claim that fails (a cancel got there first) stops the generation."""
    warm = client.post("/lmsp/v1/tasks", json=task_body(max_output_tokens=1), headers=ALICE).json()
    wait_done(client, warm["id"])  # the model is resident now
    core = client.app.state.lmsp.core  # type: ignore[attr-defined]
    store, engine = core.store, core.supervisor.engine
    assert client.portal is not None
    gate = client.portal.call(lambda: _make_event())
    transition = store.transition

    async def held_claim(task_id: str, status: str, **kwargs: Any) -> Any:
        if kwargs.get("via") == "loading":
            await gate.wait()
        return await transition(task_id, status, **kwargs)

    store.transition = held_claim
    try:
        task = client.post("/lmsp/v1/tasks", json=task_body(max_output_tokens=200), headers=ALICE).json()
        wait_until(lambda: task["id"] in engine._streams, "the generation to start before the claim lands")
        # The engine is generating; none of it is committed while the claim is pending.
        assert client.get(f"/lmsp/v1/tasks/{task['id']}", headers=ALICE).json()["status"] == "queued"
        cancel = client.post(f"/lmsp/v1/tasks/{task['id']}/cancel", headers=ALICE)
        assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"
        client.portal.call(gate.set)
        wait_until(lambda: task["id"] not in core.supervisor.running, "the supervisor to let go of the task")
        assert task["id"] not in engine._streams
    finally:
        store.transition = transition
    events = sse(client, task["id"])
    assert [e["type"] for e in events] == ["response.created", "response.cancelled"], events
    assert settle_and_check(client, task["id"], 200) == "cancelled"


async def _make_event() -> asyncio.Event:
    return asyncio.Event()
