"""PostgreSQL going away under a serving node (docs/operations.md, "Several nodes"):
new work is refused with 503 and ``Retry-After`` while it is down, nothing acknowledged is
lost, and the node serves again once it is back. A PostgreSQL of the test's own, stopped with
``-m immediate`` (as a crash would) and started again on the same port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from harness.postgres import PostgresServer, bin_dir
from harness.wait import wait_until
from lmspd.config import EngineConfig, StoreConfig
from lmspd.models.registry import ResolvedModel

ENGINE = EngineConfig(weight_dtype="quantized")  # the module's engine host (tests/conftest.py)


def body(text: str) -> dict[str, Any]:
    return {"type": "response", "input": {"input": text, "temperature": 0, "max_output_tokens": 4}}


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    found = bin_dir()
    if found is None:
        pytest.fail("PostgreSQL is not installed (initdb/pg_ctl not found; apt install postgresql)")
    server = PostgresServer(found)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def finished(client: TestClient, task_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        task: dict[str, Any] = client.get(f"/lmsp/v1/tasks/{task_id}").json()
        return task if task["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_until(done, f"task {task_id} to finish", timeout=60)


def test_postgresql_down_while_serving_is_503_with_retry_after_and_loses_nothing(
    host: Host, tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel, own_postgres: PostgresServer
) -> None:
    config = tiny_config(tiny_long, model_cache, tmp_path / "data", ENGINE)
    config = msgspec.structs.replace(config, store=StoreConfig(url=own_postgres.url()))
    with host.serve(config) as client:
        before = client.post("/lmsp/v1/tasks", json=body("Before the outage."))
        assert before.status_code == 202, before.text
        done = finished(client, before.json()["id"])
        assert done["status"] == "succeeded"

        own_postgres.pause()
        refused = client.post("/lmsp/v1/tasks", json=body("During the outage."))
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["content-type"].startswith("application/problem+json")
        v1 = client.post("/v1/responses", json={"input": "During the outage.", "max_output_tokens": 4})
        assert v1.status_code == 503 and "retry-after" in v1.headers, v1.text
        assert v1.json()["error"]["message"]

        own_postgres.resume()
        # The next batch connects again: new work is taken, what was acknowledged is intact.
        after = wait_until(
            lambda: (
                r if (r := client.post("/lmsp/v1/tasks", json=body("After the outage."))).status_code == 202 else None
            ),
            "the node to take work again",
            timeout=60,
        )
        assert finished(client, after.json()["id"])["status"] == "succeeded"
        again = client.get(f"/lmsp/v1/tasks/{before.json()['id']}").json()
        assert again["status"] == "succeeded" and again["response"] == done["response"]
