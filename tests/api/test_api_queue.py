"""Queue bound, keep-alives and engine crashes, through the real app with max_concurrency=1."""

from __future__ import annotations

import os
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from harness.wait import wait_until
from lmspd.config import Config, EngineConfig
from lmspd.models.registry import ResolvedModel


def long_task(policy: str = "fail") -> dict[str, Any]:
    return {
        "type": "response",
        "on_restart": policy,
        "input": {"input": "Tell me a story.", "temperature": 0, "max_output_tokens": 3000},
    }


# The host fixture's engine (tests/conftest.py): the crash test kills it; its app's supervisor restarts it.
ENGINE = EngineConfig(weight_dtype="quantized", max_concurrency=1)


@pytest.fixture
def config(tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel) -> Config:
    return tiny_config(tiny_long, model_cache, tmp_path / "data", ENGINE, max_queued_tasks=2, keepalive_secs=0.3)


@pytest.fixture
def client(host: Host, config: Config) -> Iterator[TestClient]:
    with host.serve(config) as c:
        yield c


def count_tasks(config: Config) -> int:
    with sqlite3.connect(config.server.database_path) as conn:
        return int(conn.execute("SELECT count(*) FROM tasks").fetchone()[0])


def status(client: TestClient, task_id: str) -> str:
    return str(client.get(f"/lmsp/v1/tasks/{task_id}").json()["status"])


def finished(client: TestClient, task_id: str) -> str | None:
    """The task's status once it is finished (None before)."""
    found = status(client, task_id)
    return found if found in ("succeeded", "failed", "cancelled") else None


def test_full_queue_is_429_with_retry_after_and_persists_nothing(client: TestClient, config: Config) -> None:
    accepted = []
    for _ in range(10):
        before = count_tasks(config)
        r = client.post("/lmsp/v1/tasks", json=long_task())
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
            assert r.json()["code"] == "rate_limit_exceeded"
            assert count_tasks(config) == before
            break
        assert r.status_code == 202
        accepted.append(r.json()["id"])
    else:
        raise AssertionError("the queue never filled")
    queued = [i for i in accepted if status(client, i) == "queued"]
    assert queued  # the supervisor may have claimed one more since the 429, never all of them
    # A queued task's stream shows its first event, then keep-alives while it waits.
    with client.stream("GET", f"/lmsp/v1/tasks/{queued[-1]}/events") as r:
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if line == ": keep-alive":
                break
    assert "event: response.created" in lines and lines[0] == "retry: 2000"
    for task_id in accepted:  # cancelling frees the queue
        assert client.post(f"/lmsp/v1/tasks/{task_id}/cancel").status_code == 200
    assert client.post("/lmsp/v1/tasks", json=long_task()).status_code == 202


def test_engine_crash_applies_policies_and_the_engine_comes_back(client: TestClient) -> None:
    supervisor = client.app.state.lmsp.core.supervisor  # type: ignore[attr-defined]
    failing = client.post("/lmsp/v1/tasks", json=long_task("fail")).json()["id"]
    wait_until(lambda: status(client, failing) == "running", "the first task to run")
    retried = client.post("/lmsp/v1/tasks", json=long_task("retry")).json()["id"]
    # Killed mid-generation: once the engine has the running task's request, not after a pause.
    wait_until(lambda: failing in supervisor.engine._streams, "the engine to generate the running task")
    os.kill(supervisor.engine.process.pid, signal.SIGKILL)
    assert wait_until(lambda: finished(client, failing), "the running task to end") == "failed"
    task = client.get(f"/lmsp/v1/tasks/{failing}").json()
    assert task["status"] == "failed" and task["error"]["code"] == "engine_crashed"
    # The supervisor restarts the engine and the queue goes on.
    client.post(f"/lmsp/v1/tasks/{retried}/cancel")
    quick = {"type": "response", "input": {"input": "Hi", "temperature": 0, "max_output_tokens": 5}}
    again = client.post("/lmsp/v1/tasks", json=quick).json()["id"]
    assert wait_until(lambda: finished(client, again), "the next task to finish") == "succeeded"
    assert client.get("/readyz").status_code == 200
