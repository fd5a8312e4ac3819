"""The real app on PostgreSQL ([store] url): LMSP tasks and /v1 responses end to end, the rows
in the database, Last-Event-ID replay, cancel and idempotency, on the tiny model and a real
PostgreSQL (harness/postgres.py). The SQLite app is tests/api/test_api_tasks.py's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psycopg
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from harness.wait import wait_until
from lmspd.config import Config, EngineConfig, StoreConfig
from lmspd.models.catalog import BUILTIN_MODELS
from lmspd.models.pull import is_pulled
from lmspd.models.registry import ResolvedModel

TOKENS = {"alice": "alice-secret-token"}
ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
ADMIN = {"ops": "ops-secret-token"}
ENGINE = EngineConfig(weight_dtype="quantized")


def task_body(text: str = "Tell me a story.", **extra: Any) -> dict[str, Any]:
    return {"type": "response", "input": {"input": text, "temperature": 0, "max_output_tokens": 16, **extra}}


def status(client: TestClient, task_id: str) -> str:
    return str(client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json()["status"])


def wait_done(client: TestClient, task_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        task: dict[str, Any] = client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json()
        return task if task["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_until(done, f"task {task_id} to finish", timeout=60)


def sse(client: TestClient, task_id: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with client.stream("GET", f"/lmsp/v1/tasks/{task_id}/events", headers={**ALICE, **(headers or {})}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(msgspec.json.decode(line[6:]))
    return events


@pytest.fixture
def pg_config(tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel, pg_url: str) -> Config:
    config = tiny_config(
        tiny_long, model_cache, tmp_path / "data", ENGINE, tokens=TOKENS, admin_tokens=ADMIN, keepalive_secs=0.5
    )
    return msgspec.structs.replace(config, store=StoreConfig(url=pg_url))


@pytest.fixture
def client(host: Host, pg_config: Config) -> Iterator[TestClient]:
    with host.serve(pg_config) as c:
        yield c


def rows(config: Config, sql: str) -> list[tuple[Any, ...]]:
    assert config.store.url is not None
    with psycopg.connect(config.store.url) as conn:
        return conn.execute(sql).fetchall()


def test_a_task_runs_on_postgresql_and_replays_from_every_id(client: TestClient, pg_config: Config) -> None:
    r = client.post("/lmsp/v1/tasks", json=task_body(), headers=ALICE)
    assert r.status_code == 202
    task = r.json()
    # Committed before the 202: another connection sees its first event.
    assert rows(pg_config, f"SELECT seq, type FROM events WHERE task_id = '{task['id']}'")[0] == (0, "response.created")
    done = wait_done(client, task["id"])
    assert done["status"] == "succeeded" and done["response"]["usage"]["output_tokens"] == 16
    events = sse(client, task["id"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == done["response"]["output"][0]["content"][0]["text"]
    for n in range(-1, len(events) - 1, 5):
        assert sse(client, task["id"], {"Last-Event-ID": str(n)}) == events[n + 1 :]
    assert rows(pg_config, f"SELECT status FROM tasks WHERE id = '{task['id']}'") == [("succeeded",)]


def test_v1_responses_sync_stored_and_chained(client: TestClient) -> None:
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 8, "temperature": 0}
    first = client.post("/v1/responses", json=body, headers=ALICE)
    assert first.status_code == 200, first.text
    again = client.get(f"/v1/responses/{first.json()['id']}", headers=ALICE)
    assert again.status_code == 200 and again.json()["output"] == first.json()["output"]
    chained = client.post("/v1/responses", json={**body, "previous_response_id": first.json()["id"]}, headers=ALICE)
    assert chained.status_code == 200 and chained.json()["previous_response_id"] == first.json()["id"]
    assert client.delete(f"/v1/responses/{first.json()['id']}", headers=ALICE).status_code == 200
    assert client.get(f"/v1/responses/{first.json()['id']}", headers=ALICE).status_code == 404


def test_cancel_and_idempotency_on_postgresql(client: TestClient, pg_config: Config) -> None:
    long = task_body(max_output_tokens=2000)
    task_id = client.post("/lmsp/v1/tasks", json=long, headers=ALICE).json()["id"]
    wait_until(lambda: status(client, task_id) == "running", f"task {task_id} to run")
    assert client.post(f"/lmsp/v1/tasks/{task_id}/cancel", headers=ALICE).json()["status"] in (
        "cancelling",
        "cancelled",
    )
    assert wait_done(client, task_id)["status"] == "cancelled"
    headers = {**ALICE, "Idempotency-Key": "once"}
    ids = {client.post("/lmsp/v1/tasks", json=task_body(), headers=headers).json()["id"] for _ in range(3)}
    assert len(ids) == 1
    assert rows(pg_config, "SELECT count(*) FROM idempotency_keys") == [(1,)]


def test_the_cluster_route_lists_this_node_to_operators(client: TestClient, pg_config: Config) -> None:
    assert client.get("/lmsp/v1/cluster", headers=ALICE).status_code == 403
    r = client.get("/lmsp/v1/cluster", headers={"Authorization": "Bearer ops-secret-token"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["store"] == "postgresql" and body["epoch"] is not None
    [node] = body["nodes"]
    assert (node["id"], node["epoch"], node["expired"]) == (body["node"], body["epoch"], False)
    # What it serves: its default model and aliases, and the built-ins pulled into its cache.
    pulled = {name for name in BUILTIN_MODELS if is_pulled(pg_config.model_cache_dir / name)}
    assert node["models"] == sorted({"tiny", *pulled}) and node["expires_at"] > node["heartbeat_at"]


def test_metrics_name_this_node_and_count_the_nodes_by_lease(client: TestClient) -> None:
    ops = {"Authorization": "Bearer ops-secret-token"}
    body = client.get("/lmsp/v1/cluster", headers=ops).json()

    def metrics() -> str:
        return client.get("/metrics", headers=ops).text

    assert f'lmspd_node_info{{epoch="{body["epoch"]}",node="{body["node"]}"}} 1.0' in metrics()  # labels sorted
    assert "lmspd_node_leases_lost_total 0.0" in metrics()
    assert "lmspd_node_tasks_taken_over_total 0.0" in metrics()
    # Counted at each heartbeat: this node alone, its lease live.
    wait_until(lambda: 'lmspd_cluster_nodes{lease="live"} 1.0' in metrics(), "a heartbeat to count the nodes")
    assert 'lmspd_cluster_nodes{lease="expired"} 0.0' in metrics()
