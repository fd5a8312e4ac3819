"""/metrics (Prometheus) and the logs: request lines, JSON lines, no prompt text."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from engine_host import Host, engine_host
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from service.api import events
from service.cli import build_parser
from service.config import Config, EngineConfig, ModelEntry, ServerConfig
from service.logs import JsonFormatter, current_format, formatter
from service.models.registry import ResolvedModel

TOKENS = {"alice": "alice-secret-token"}
ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
ENGINE = EngineConfig(weight_dtype="quantized")
PROMPT = "Tell me a story about the zebra Quagga-4711."

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    with engine_host(ENGINE) as h:
        yield h


@pytest.fixture
def server_config(tmp_path: Path, model_cache: Path, tiny: ResolvedModel) -> Config:
    return Config(
        default_model="tiny",
        cache_dir=str(model_cache),
        models={"tiny": ModelEntry(path=str(tiny.path))},
        engine=ENGINE,
        server=ServerConfig(data_dir=str(tmp_path / "data"), tokens=TOKENS, keepalive_secs=0.5),
    )


def scrape(client: TestClient) -> Samples:
    r = client.get("/metrics", headers=ALICE)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def wait_done(client: TestClient, task_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        task: dict[str, Any] = client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json()
        if task["status"] in ("succeeded", "failed", "cancelled"):
            return task
        time.sleep(0.02)
    raise AssertionError(f"task {task_id} did not finish")


def test_metrics_move_by_what_the_tasks_did(
    host: Host, server_config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lmspd")
    with host.serve(server_config) as client:
        assert client.get("/metrics").status_code == 401  # tokens are configured: one is required
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
    assert value(again, "lmspd_tasks", status="succeeded") == 2


def test_open_streams_are_counted_until_they_close(host: Host, server_config: Config) -> None:
    with host.serve(server_config) as client:
        task = client.post(
            "/lmsp/v1/tasks", json={"type": "response", "input": {"input": "Hi", "max_output_tokens": 2}}, headers=ALICE
        ).json()
        wait_done(client, task["id"])
        core = client.app.state.lmsp.core  # type: ignore[attr-defined]
        stream = cast(AsyncGenerator[bytes, None], events._lmsp_stream(core, task["id"], -1))
        assert client.portal is not None
        assert client.portal.call(stream.__anext__) == b"retry: 2000\n\n"
        assert value(scrape(client), "lmspd_sse_streams_open", api="lmsp") == 1
        client.portal.call(stream.aclose)
        assert value(scrape(client), "lmspd_sse_streams_open", api="lmsp") == 0


def test_json_log_lines_carry_the_fields() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter("json"))
    logger = logging.getLogger("lmspd.test.json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("GET %s %d", "/healthz", 200, extra={"path": "/healthz", "status": 200, "ms": 0.4})
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    first, second = (msgspec.json.decode(line) for line in out.getvalue().splitlines())
    assert first["msg"] == "GET /healthz 200" and first["level"] == "WARNING" and first["logger"] == "lmspd.test.json"
    assert (first["path"], first["status"], first["ms"]) == ("/healthz", 200, 0.4)
    assert first["ts"].endswith("+00:00") and "T" in first["ts"]
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"]


def test_log_format_flag_and_what_the_engine_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args(["serve", "--log-format", "json"]).log_format == "json"
    assert build_parser().parse_args(["serve"]).log_format == "text"
    monkeypatch.setenv("LMSPD_LOG_FORMAT", "json")
    assert build_parser().parse_args(["serve"]).log_format == "json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-format", "xml"])
    root = logging.getLogger()
    assert current_format() == "text"
    handler = logging.NullHandler()
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    try:
        assert current_format() == "json"
    finally:
        root.removeHandler(handler)
