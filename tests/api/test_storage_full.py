"""A full database, on the real app and a real SQLite file: ``PRAGMA max_page_count`` on the
writer connection is a full disk that a test can turn on and off.

Intake answers 503 with a clear body on both surfaces and writes nothing half; generation
stopped by the full storage is settled by each task's ``on_restart`` policy once there is
room, after a backoff, said once in the log; and all of it recovers by itself."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host, tiny_config
from harness.wait import wait_until
from lmspd.config import Config, EngineConfig
from lmspd.models.registry import ResolvedModel
from lmspd.store.db import Database, SqliteDatabase, on_thread

ENGINE = EngineConfig(weight_dtype="quantized")
TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def config(tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel) -> Config:
    return tiny_config(tiny_long, model_cache, tmp_path / "data", ENGINE, keepalive_secs=0.5)


@pytest.fixture
def client(host: Host, config: Config) -> Iterator[TestClient]:
    with host.serve(config) as c:
        yield c


def set_room(host: Host, client: TestClient, pages: int | None) -> None:
    """Let the database grow by ``pages`` more pages from now (None: without a limit)."""
    db: SqliteDatabase = client.app.state.lmsp.core.store.db  # type: ignore[attr-defined]

    def limit(conn: sqlite3.Connection) -> None:
        now = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {2**31 - 2 if pages is None else now + pages}")

    host.portal.call(on_thread, db._writer_conn, limit)


def body(text: str, on_restart: str = "fail", max_tokens: int = 8) -> dict[str, Any]:
    return {
        "type": "response",
        "on_restart": on_restart,
        "input": {"input": text, "temperature": 0, "max_output_tokens": max_tokens},
    }


def rows(config: Config, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(config.server.database_path) as conn:
        return conn.execute(sql).fetchall()


def wait_all(client: TestClient, ids: list[str], timeout: float = 90) -> dict[str, dict[str, Any]]:
    def tasks() -> dict[str, dict[str, Any]]:
        return {i: client.get(f"/lmsp/v1/tasks/{i}").json() for i in ids}

    def finished() -> dict[str, dict[str, Any]] | None:
        found = tasks()
        return found if all(t["status"] in TERMINAL for t in found.values()) else None

    return wait_until(finished, lambda: {i: t["status"] for i, t in tasks().items()}, timeout=timeout, interval=0.1)


def test_intake_answers_503_writes_nothing_half_and_recovers(host: Host, client: TestClient, config: Config) -> None:
    set_room(host, client, 0)
    accepted: list[str] = []
    for i in range(60):  # the pages' free space runs out after a few of these
        r = client.post("/lmsp/v1/tasks", json=body(f"{i} " + "words " * 700), headers={"Idempotency-Key": f"k{i}"})
        if r.status_code == 503:
            break
        assert r.status_code == 202, r.text
        accepted.append(r.json()["id"])
    else:
        raise AssertionError("the database never filled up")
    problem = r.json()
    assert r.headers["content-type"] == "application/problem+json" and r.headers["retry-after"]
    assert (problem["status"], problem["code"]) == (503, "storage_full")
    assert "storage is full" in problem["detail"] and "nothing was written" in problem["detail"]
    r = client.post("/v1/responses", json={"input": "words " * 700, "max_output_tokens": 4})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "overloaded" and "storage is full" in error["message"]
    # Nothing half: every task on disk is one that was answered 202, with its whole first write
    # (its events and its idempotency key); the refused ones left no row anywhere.
    on_disk = {row[0] for row in rows(config, "SELECT id FROM tasks")}
    assert on_disk == set(accepted)
    assert rows(config, "SELECT COUNT(*) FROM idempotency_keys") == [(len(accepted),)]
    torn = "SELECT id FROM tasks t WHERE next_seq != (SELECT COUNT(*) FROM events WHERE task_id = t.id)"
    assert not rows(config, torn)
    set_room(host, client, None)  # space is back: the very next request succeeds
    r = client.post("/lmsp/v1/tasks", json=body("again"), headers={"Idempotency-Key": "k-after"})
    assert r.status_code == 202, r.text
    done = wait_all(client, [*accepted, r.json()["id"]])
    assert {t["status"] for t in done.values()} == {"succeeded"}


def test_generation_stopped_by_a_full_disk_follows_each_policy(
    host: Host, client: TestClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="lmspd")
    storage = client.app.state.lmsp.core.supervisor.storage  # type: ignore[attr-defined]
    rounds: list[float] = []  # each wait the supervisor's backoff took, as it is taken

    waited = storage.longer

    def longer() -> None:
        rounds.append(storage.wait)
        waited()

    monkeypatch.setattr(storage, "longer", longer)
    ids = {
        policy: client.post("/lmsp/v1/tasks", json=body("Tell me a story.", policy, 300)).json()["id"]
        for policy in ("fail", "retry", "resume")
    }
    set_room(host, client, 1)  # room for a few events each: then the disk is full mid-generation
    wait_until(lambda: any("is full" in r.getMessage() for r in caplog.records), "the generations to fill the database")
    # Several rounds of the supervisor's backoff, still full: two waited out, as they happen.
    # (A small write may still fit in a page's free space: a stopped task may be settled
    # meanwhile, a requeued one claimed.)
    wait_until(lambda: len(rounds) >= 2, lambda: f"two rounds of the backoff, still full: {rounds}")
    set_room(host, client, None)
    done = wait_all(client, list(ids.values()))
    failed = done[ids["fail"]]
    assert failed["status"] == "failed" and failed["error"]["code"] == "storage_full", failed
    assert done[ids["retry"]]["status"] == "succeeded" and done[ids["retry"]]["attempt"] >= 2
    assert done[ids["resume"]]["status"] == "succeeded" and done[ids["resume"]]["attempt"] == 1
    said = [r for r in caplog.records if r.name.startswith("lmspd")]
    assert [r.getMessage() for r in said if "is full" in r.getMessage()] == [
        f"the database {client.app.state.lmsp.config.server.database_path} is full: generation stops and "  # type: ignore[attr-defined]
        "intake answers 503 until there is room; the interrupted tasks then follow their on_restart policy"
    ]
    assert not [r for r in said if r.exc_info], "a traceback was logged"
    assert [r.getMessage() for r in said if "has room again" in r.getMessage()]


async def test_restart_with_the_disk_still_full_waits_and_then_follows_each_policy(
    tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """Recovery at start cannot write either: the server starts anyway (reads still work),
    the interrupted tasks wait, said once, and are settled by their policies once there is room."""
    from lmspd.core.hub import Hub
    from lmspd.core.service import compose
    from lmspd.core.supervisor import Supervisor
    from lmspd.engine.process import EngineClient
    from lmspd.models.registry import ModelRegistry
    from lmspd.responses.checks import accept
    from lmspd.responses.schema import ResponseRequest
    from lmspd.store.task_store import TaskStore

    caplog.set_level(logging.INFO, logger="lmspd")
    config = tiny_config(tiny_long, model_cache, tmp_path)
    db = await Database.open(config.server.database_path)
    store, hub, registry = TaskStore(db), Hub(), ModelRegistry(config)
    supervisor = Supervisor(config, store, EngineClient(EngineConfig()), hub, registry)
    core = compose(config, store, hub, supervisor, registry, store.metrics)
    request = msgspec.json.decode(b'{"input": "hi", "max_output_tokens": 4}', type=ResponseRequest)
    ids = {
        policy: (await core.intake.submit("alice", accept(request), kind="task", on_restart=policy))[0].id
        for policy in ("fail", "retry", "resume")
    }

    # As a kill -9 mid-generation leaves them; then the disk fills up: every page is taken
    # and the pages' free space filled (by another connection, as another writer would).
    with contextlib.closing(sqlite3.connect(config.server.database_path, isolation_level=None)) as other:
        other.execute("UPDATE tasks SET status = 'running'")
        other.execute(f"PRAGMA max_page_count = {other.execute('PRAGMA page_count').fetchone()[0]}")
        for task_id in ids.values():  # events sort by task: fill the pages next to each one's
            with contextlib.suppress(sqlite3.OperationalError):
                for i in range(100_000):
                    add = "INSERT INTO events (task_id, seq, type, data) VALUES (?, ?, 'x', x'00')"
                    other.execute(add, (f"{task_id}~", i))
    set_limit = "PRAGMA max_page_count = 1"  # no page more than it has now
    await on_thread(db._writer_conn, lambda conn: conn.execute(set_limit))
    await supervisor.transitions.recover()  # does not raise: the start goes on
    # The failure's event needs room; a resume's requeue (a status change) may fit in place.
    assert ids["fail"] in supervisor.storage.stalled
    assert {(await store.get(i)).status for i in supervisor.storage.stalled} == {"running"}
    assert not await supervisor.transitions.settle_stalled()  # still full: backs off
    await on_thread(db._writer_conn, lambda conn: conn.execute(f"PRAGMA max_page_count = {2**31 - 2}"))
    assert await supervisor.transitions.settle_stalled()
    tasks = {policy: await store.get(i) for policy, i in ids.items()}
    assert (tasks["fail"].status, msgspec.json.decode(tasks["fail"].error or b"{}")["code"]) == (
        "failed",
        "storage_full",
    )
    assert (tasks["retry"].status, tasks["retry"].attempt) == ("queued", 2)
    assert (tasks["resume"].status, tasks["resume"].attempt) == ("queued", 1)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("lmspd")]
    assert len([m for m in said if " is full: " in m]) == 1 and any("has room again" in m for m in said)
    assert not [r for r in caplog.records if r.exc_info]
    await db.close()


def test_with_the_storage_full_a_sync_request_and_a_stream_end_as_their_tasks_will(
    host: Host, client: TestClient, config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    """Both used to wait for room that may never come (a sync request: minutes, as long as
    anyone watched). Now the sync request answers 503 naming its response, the stream ends
    with an ``error`` event and ``[DONE]``, and once there is room each task fails by its
    policy (``storage_full``): the stored one stays readable, the other is forgotten."""
    caplog.set_level(logging.INFO, logger="lmspd")
    long = {"input": "Tell me a story.", "temperature": 0, "max_output_tokens": 300}
    answers: dict[str, Any] = {}

    def post(name: str, body: dict[str, Any]) -> None:
        answers[name] = client.post("/v1/responses", json=body)

    requests = {"sync": long, "stream": {**long, "stream": True, "store": False}}
    threads = [threading.Thread(target=post, args=item, daemon=True) for item in requests.items()]
    for thread in threads:
        thread.start()
    running = "SELECT response_id, stored FROM tasks WHERE status = 'running'"
    started = wait_until(lambda: rows(config, running) if len(rows(config, running)) == 2 else None, "both to run")
    set_room(host, client, 1)
    for thread in threads:
        thread.join(60)
    assert not [t for t in threads if t.is_alive()], f"still waiting for room: {answers}"
    sync, stream = answers["sync"], answers["stream"]
    assert sync.status_code == 503, sync.text
    error = sync.json()["error"]
    (stored_id,) = [rid for rid, stored in started if stored]
    assert error["type"] == "overloaded" and "storage is full" in error["message"] and stored_id in error["message"]
    frames = [f for f in stream.text.split("\n\n") if f.strip()]
    assert frames[-1] == "data: [DONE]" and frames[-2].startswith("event: error\ndata: "), frames[-3:]
    ended = msgspec.json.decode(frames[-2].split("data: ", 1)[1])
    assert ended["code"] == "storage_full" and not [f for f in frames[:-2] if '"response.failed"' in f]
    set_room(host, client, None)
    response = wait_until(
        lambda: (r := client.get(f"/v1/responses/{stored_id}").json())["status"] == "failed" and r,
        "the stored response to fail by its policy",
    )
    assert response["error"]["code"] == "storage_full"
    (forgotten,) = [rid for rid, stored in started if not stored]
    wait_until(lambda: not rows(config, f"SELECT id FROM tasks WHERE response_id = '{forgotten}'"), "it to be released")
