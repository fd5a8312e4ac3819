"""Engine recycling under load on the real app: 8 streams and a queue, the engine replaced
midway; every task succeeds with the greedy text of an uninterrupted run, its event stream
gap-free, whatever its on_restart policy (the server did not restart)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, Hosts, tiny_config
from harness.wait import wait_until
from lmspd.config import EngineConfig
from lmspd.models.registry import ResolvedModel

# Running generations get no time to finish: all of them resume on the next engine.
ENGINE = EngineConfig(weight_dtype="quantized", max_concurrency=8, recycle_drain_secs=0)
# ...or all the time they need: they finish on the old one.
DRAINING = EngineConfig(weight_dtype="quantized", max_concurrency=8, recycle_drain_secs=600)
TASKS = 12  # 8 streams and a queue
TOKENS = 200
# The texts of an uninterrupted run, the same under both configs (greedy, and a row's result
# does not depend on its batch: tests/engine/test_engine.py::test_a_seeded_request_is_unaffected_by_its_batch),
# computed by whichever test runs first, compared by both.
UNINTERRUPTED: list[str] = []


def submit(client: TestClient, i: int) -> str:
    body = {
        "type": "response",
        "on_restart": "fail",  # a recycle resumes it anyway
        "input": {"input": f"Story {i}: once upon a time", "temperature": 0, "max_output_tokens": TOKENS},
    }
    r = client.post("/lmsp/v1/tasks", json=body)
    assert r.status_code == 202, r.text
    task_id: str = r.json()["id"]
    return task_id


def task(client: TestClient, task_id: str) -> dict[str, Any]:
    found: dict[str, Any] = client.get(f"/lmsp/v1/tasks/{task_id}").json()
    return found


def wait_all(client: TestClient, ids: list[str]) -> list[dict[str, Any]]:
    def done() -> list[dict[str, Any]] | None:
        tasks = [task(client, t) for t in ids]
        return tasks if all(t["status"] in ("succeeded", "failed", "cancelled") for t in tasks) else None

    return wait_until(done, "every task to finish", timeout=300)


def text_of(t: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in t["response"]["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def streamed_text(client: TestClient, task_id: str) -> str:
    """The output text as the task's event stream delivered it, checked to have no gap."""
    events: list[dict[str, Any]] = []
    with client.stream("GET", f"/lmsp/v1/tasks/{task_id}/events") as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(msgspec.json.decode(line[len("data: ") :]))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def metric(client: TestClient, line: str) -> bool:
    return line in client.get("/metrics").text


def recycled_run(client: TestClient) -> tuple[list[str], list[str]]:
    """The tasks' texts uninterrupted, and with a recycle midway."""
    if not UNINTERRUPTED:
        UNINTERRUPTED[:] = [text_of(t) for t in wait_all(client, [submit(client, i) for i in range(TASKS)])]
    alone = list(UNINTERRUPTED)
    supervisor = client.app.state.lmsp.core.supervisor  # type: ignore[attr-defined]
    before = supervisor.engine.process.pid
    ids = [submit(client, i) for i in range(TASKS)]
    # Midway: the first generations are running, the rest queued behind them.
    wait_until(lambda: task(client, ids[0])["status"] == "running", "the first task to run", timeout=60)
    r = client.post("/lmsp/v1/engine/recycle")
    assert r.status_code == 202 and r.json() == {"started": True}
    tasks = wait_all(client, ids)
    assert [t["status"] for t in tasks] == ["succeeded"] * TASKS, [t["error"] for t in tasks]
    assert all(t["attempt"] == 1 for t in tasks)  # resumed, not retried
    wait_until(lambda: not supervisor.recycler.busy, "the recycle to end", timeout=60)
    assert supervisor.engine.process.pid != before and supervisor.engine.alive
    assert metric(client, 'lmspd_engine_recycles_total{reason="operator"} 1.0')
    for task_id, t in zip(ids, tasks, strict=True):
        assert streamed_text(client, task_id) == text_of(t)  # no token lost or repeated
    return alone, [text_of(t) for t in tasks]


def test_a_recycle_resumes_running_generations_on_the_next_engine(
    host: Host, tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lmspd.supervisor")
    with host.serve(tiny_config(tiny_long, model_cache, tmp_path / "data", ENGINE)) as client:
        alone, recycled = recycled_run(client)
    assert recycled == alone
    resumed = [r for r in caplog.records if "resuming them on the next engine" in r.getMessage()]
    assert resumed and int(resumed[0].getMessage().split()[2]) >= 1  # some were interrupted, and resumed


def test_a_recycle_lets_running_generations_finish_on_the_old_engine(
    engine_hosts: Hosts, tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lmspd.supervisor")
    with engine_hosts.get(DRAINING).serve(tiny_config(tiny_long, model_cache, tmp_path / "data", DRAINING)) as client:
        alone, recycled = recycled_run(client)
    assert recycled == alone
    assert not [r for r in caplog.records if "resuming them on the next engine" in r.getMessage()]
