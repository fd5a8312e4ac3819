"""Regressions of the service layer: one meaning for a request on /v1 and /lmsp/v1, purged
logs, the background cap under concurrency, cancel of a resumed task."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, purge
from harness.openresponses import validate
from harness.wait import wait_until
from lmspd.config import Config, EngineConfig, ModelEntry, ResponsesConfig, ServerConfig
from lmspd.core import Core
from lmspd.core.endings import Endings
from lmspd.core.hub import Hub
from lmspd.core.reads import Reads
from lmspd.core.storage_backoff import StorageBackoff
from lmspd.models.registry import ResolvedModel
from lmspd.responses.builder import ResponseState, initial_response
from lmspd.responses.schema import OutputMessage, Response, TaskRequest
from lmspd.store.db import Database
from lmspd.store.task_store import TaskStore

TOKENS = {"alice": "alice-secret-token", "bob": "bob-secret-token"}
ALICE = {"Authorization": f"Bearer {TOKENS['alice']}"}
BOB = {"Authorization": f"Bearer {TOKENS['bob']}"}
QUICK = {"input": "Hi", "temperature": 0, "max_output_tokens": 4}
ENGINE = EngineConfig(weight_dtype="quantized", max_concurrency=1)


def config_for(tmp_path: Path, model_cache: Path, tiny: ResolvedModel, **responses: int) -> Config:
    return Config(
        default_model="tiny",
        cache_dir=str(model_cache),
        models={"tiny": ModelEntry(path=str(tiny.path))},
        engine=ENGINE,
        server=ServerConfig(data_dir=str(tmp_path / "data"), tokens=TOKENS, keepalive_secs=0.5),
        responses=msgspec.convert(responses, ResponsesConfig),
    )


@pytest.fixture
def client(host: Host, tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[TestClient]:
    with host.serve(config_for(tmp_path, model_cache, tiny_long, background_max_jobs=64)) as c:
        yield c


def finish(client: TestClient, task_id: str) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        task = dict(client.get(f"/lmsp/v1/tasks/{task_id}", headers=ALICE).json())
        return task if task["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_until(finished, f"task {task_id} to finish")


def response_status(client: TestClient, response_id: str) -> str:
    return str(client.get(f"/v1/responses/{response_id}", headers=ALICE).json()["status"])


def test_a_task_input_means_what_it_means_on_v1(client: TestClient) -> None:
    first = client.post("/v1/responses", json={**QUICK, "input": "First."}, headers=ALICE).json()
    body = {"input": "Second.", "previous_response_id": first["id"], "temperature": 0, "max_output_tokens": 4}
    task = client.post("/lmsp/v1/tasks", json={"type": "response", "input": body}, headers=ALICE).json()
    via_task = finish(client, task["id"])["response"]
    via_v1 = client.post("/v1/responses", json=body, headers=ALICE).json()
    assert via_task["usage"]["input_tokens"] == via_v1["usage"]["input_tokens"]  # the same history
    alone = client.post("/v1/responses", json={**QUICK, "input": "Second."}, headers=ALICE).json()
    assert via_task["usage"]["input_tokens"] > alone["usage"]["input_tokens"]
    assert via_task["previous_response_id"] == first["id"]
    # Unknown, another tenant's, and unfinished ids are refused as on /v1, and nothing is written.
    for headers, previous in [(ALICE, "resp_made_up"), (BOB, first["id"])]:
        bad = {"type": "response", "input": {**body, "previous_response_id": previous}}
        r = client.post("/lmsp/v1/tasks", json=bad, headers=headers)
        assert r.status_code == 400 and r.json()["param"] == "previous_response_id", r.text
    conv: dict[str, Any] = {"type": "response", "input": {**QUICK, "input": "One.", "conversation": "conv_t"}}
    one = finish(client, client.post("/lmsp/v1/tasks", json=conv, headers=ALICE).json()["id"])
    conv["input"]["input"] = "Two."
    two = finish(client, client.post("/lmsp/v1/tasks", json=conv, headers=ALICE).json()["id"])
    assert two["response"]["usage"]["input_tokens"] > one["response"]["usage"]["input_tokens"]


def test_a_tasks_response_is_readable_on_v1(client: TestClient) -> None:
    task = client.post("/lmsp/v1/tasks", json={"type": "response", "input": QUICK}, headers=ALICE).json()
    done = finish(client, task["id"])
    r = client.get(f"/v1/responses/{task['response_id']}", headers=ALICE)
    assert r.status_code == 200 and r.json() == done["response"]
    with client.stream("GET", f"/v1/responses/{task['response_id']}?stream=true", headers=ALICE) as s:
        lines = list(s.iter_lines())
    assert lines[0] == "event: response.created" and "data: [DONE]" in lines
    assert client.get(f"/v1/responses/{task['response_id']}", headers=BOB).status_code == 404


def test_finished_tasks_after_their_events_are_purged(client: TestClient) -> None:
    quick = client.post("/v1/responses", json={**QUICK, "background": True}, headers=ALICE).json()
    long = client.post("/v1/responses", json={**QUICK, "background": True, "max_output_tokens": 3000}, headers=ALICE)
    cancelled = client.post(f"/v1/responses/{long.json()['id']}/cancel", headers=ALICE).json()
    assert cancelled["status"] == "cancelled"
    wait_until(
        lambda: response_status(client, quick["id"]) not in ("queued", "in_progress"), "the quick response to end"
    )
    purge(client, events_older_than=1)
    core: Core = client.app.state.lmsp.core  # type: ignore[attr-defined]
    for rid, status, cancel_status in [(quick["id"], "incomplete", 409), (long.json()["id"], "cancelled", 200)]:
        r = client.get(f"/v1/responses/{rid}", headers=ALICE)
        assert r.status_code == 200 and r.json()["status"] == status, r.text
        validate("ResponseResource", r.json())
        assert client.portal is not None
        task = client.portal.call(core.store.get_by_response, rid)
        assert task is not None
        assert client.post(f"/lmsp/v1/tasks/{task.id}/cancel", headers=ALICE).status_code == cancel_status
        assert client.post(f"/v1/responses/{rid}/cancel", headers=ALICE).json()["status"] == status


def test_a_failed_background_response_survives_the_purge(
    host: Host, tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel
) -> None:
    config = config_for(tmp_path, model_cache, tiny_long)
    with host.serve(config) as c:
        b = c.post("/v1/responses", json={**QUICK, "background": True, "max_output_tokens": 3000}, headers=ALICE)
        wait_until(lambda: response_status(c, b.json()["id"]) != "queued", "the background response to start")
    with host.serve(config) as c:  # a restart: fail policy -> failed server_restarted
        rid = b.json()["id"]
        assert c.get(f"/v1/responses/{rid}", headers=ALICE).json()["status"] == "failed"
        purge(c, events_older_than=1)
        r = c.get(f"/v1/responses/{rid}", headers=ALICE)
        assert r.status_code == 200 and r.json()["error"]["code"] == "server_restarted"
        task = c.get("/lmsp/v1/tasks", headers=ALICE).json()["data"][0]
        assert task["status"] == "failed" and task["response"] is None  # docs/lmsp.md §7.1: only when succeeded
        r = c.post(f"/lmsp/v1/tasks/{task['id']}/cancel", headers=ALICE)
        assert r.status_code == 409 and r.json()["code"] == "task_not_cancelable"


def test_background_cap_holds_under_concurrency(
    host: Host, tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel
) -> None:
    config = config_for(tmp_path, model_cache, tiny_long, background_max_jobs=64)
    with host.serve(config) as c:
        body = {**QUICK, "background": True, "max_output_tokens": 3000}
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda _: c.post("/v1/responses", json=body, headers=ALICE), range(200)))
        accepted = [r for r in results if r.status_code == 200]
        refused = [r for r in results if r.status_code != 200]
        assert {r.status_code for r in refused} <= {429}
        assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
        store = c.app.state.lmsp.core.store  # type: ignore[attr-defined]
        assert c.portal is not None
        tasks = [c.portal.call(store.get_by_response, r.json()["id"]) for r in accepted]
        finished = sum(t.finished_at is not None for t in tasks)
        # A job that ended while others were being created frees its place, nothing more.
        assert 64 <= len(accepted) <= 64 + finished
        for r in accepted:
            c.post(f"/v1/responses/{r.json()['id']}/cancel", headers=ALICE)


class _Supervisor:
    """Stands in for the supervisor of a task that was requeued and is waiting its turn."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def wake(self) -> None:
        pass

    async def cancel(self, task_id: str) -> None:
        self.cancelled.append(task_id)


async def test_cancel_of_a_resumed_task_keeps_its_streamed_output(tmp_path: Path, model_cache: Path) -> None:
    config = Config(cache_dir=str(model_cache), server=ServerConfig(data_dir=str(tmp_path)))
    db = await Database.open(config.server.database_path)
    store = TaskStore(db)
    hub, supervisor = Hub(), _Supervisor()
    reads = Reads(config, store, hub, StorageBackoff(config.server.database_path))
    endings = Endings(config, store, hub, reads, supervisor.cancel)
    request = TaskRequest(input="Hi")
    state = ResponseState(initial_response(request, response_id="x", model="m", created_at=0))
    task, _ = await store.create(
        owner="", request=msgspec.json.encode(request), on_restart="resume", first_event=state.created()[0]
    )
    await store.transition(task.id, "loading")
    await store.transition(task.id, "running", events=state.in_progress())
    await store.append_events(task.id, state.delta("Once upon", [1, 2]))
    await store.append_events(task.id, state.delta(" a time", [3]))
    await store.requeue(task.id, new_attempt=False)  # a restart with on_restart: resume
    done = await endings.cancel(task.id, "")
    assert done.status == "cancelled"
    final = msgspec.json.decode(await reads.snapshot(done), type=Response)
    (message,) = final.output
    assert isinstance(message, OutputMessage)
    assert final.status == "cancelled" and message.content[0].text == "Once upon a time"
    await db.close()
