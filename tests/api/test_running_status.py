"""``running`` is what the engine decodes (docs/lmsp.md §7.2): with ``max_concurrency = 2`` and four
long tasks on a resident model, two generate and read ``running`` while the other two wait
``queued``; once the first two are cancelled, the other two run in their place."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from harness.wait import wait_until
from lmspd.config import EngineConfig
from lmspd.models.registry import ResolvedModel

ENGINE = EngineConfig(weight_dtype="quantized", max_concurrency=2)
FINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def client(host: Host, tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[TestClient]:
    # The app's start loads the default model: every task below finds it resident.
    with host.serve(tiny_config(tiny_long, model_cache, tmp_path / "data", ENGINE)) as c:
        yield c


def submit(client: TestClient, i: int) -> str:
    body = {"type": "response", "input": {"input": f"Story {i}:", "temperature": 0, "max_output_tokens": 3000}}
    r = client.post("/lmsp/v1/tasks", json=body)
    assert r.status_code == 202, r.text
    task_id: str = r.json()["id"]
    return task_id


def generated(client: TestClient, task_id: str) -> bool:
    """The task's log holds a token: the engine has decoded for it."""
    store = client.app.state.lmsp.core.store  # type: ignore[attr-defined]
    assert client.portal is not None
    events = client.portal.call(store.events_after, task_id, -1, 10_000)
    return any(e.type == "response.output_text.delta" for e in events)


def statuses(client: TestClient, ids: list[str]) -> dict[str, str]:
    return {t: str(client.get(f"/lmsp/v1/tasks/{t}").json()["status"]) for t in ids}


def generating(client: TestClient, ids: list[str], n: int) -> list[str]:
    """Wait until ``n`` of ``ids`` have generated a token; those."""

    def found() -> list[str] | None:
        them = [t for t in ids if generated(client, t)]
        return them if len(them) >= n else None

    return wait_until(found, lambda: f"{n} of the tasks to generate: {statuses(client, ids)}")


def test_only_what_the_engine_decodes_reads_running(client: TestClient) -> None:
    ids = [submit(client, i) for i in range(4)]
    try:
        first = generating(client, ids, 2)
        # Two slots: the two generating hold them, and 3000 tokens each keep them held.
        assert len(first) == 2
        assert statuses(client, ids) == {t: "running" if t in first else "queued" for t in ids}
        for t in first:
            client.post(f"/lmsp/v1/tasks/{t}/cancel")
        rest = [t for t in ids if t not in first]
        assert sorted(generating(client, rest, 2)) == sorted(rest)  # the queued ones run in their place
        assert statuses(client, rest) == dict.fromkeys(rest, "running")
    finally:
        for t in ids:
            client.post(f"/lmsp/v1/tasks/{t}/cancel")
        wait_until(lambda: set(statuses(client, ids).values()) <= set(FINAL), "every task to end")
    assert statuses(client, ids) == dict.fromkeys(ids, "cancelled")
