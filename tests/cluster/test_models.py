"""Claims by model (docs/operations.md, "Several nodes"): two real ``lmspd serve`` nodes
on one real PostgreSQL serving different models. A task posted to a node that does not serve its
model is accepted (another live node serves it) and runs there; a model no node serves is the
same 404 naming ``model`` as on one node, with nothing written."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.server import Server, tiny_server, wait_final
from lmspd.models.registry import ResolvedModel


@pytest.fixture
def two(
    tmp_path: Path, model_cache: Path, tiny: ResolvedModel, tiny2: ResolvedModel, pg_url: str
) -> Iterator[list[Server]]:
    with contextlib.ExitStack() as stack:
        servers = []
        for name, models in (("n1", ""), ("n2", f'[models.other]\npath = "{tiny2.path}"\n')):
            (tmp_path / name).mkdir()
            cluster = f'[store]\nurl = "{pg_url}"\n[cluster]\nnode_id = "{name}"\nheartbeat_secs = 0.5\n'
            server = tiny_server(tmp_path / name, model_cache, tiny, models=models, responses=cluster)
            servers.append(stack.enter_context(server))
        threads = [threading.Thread(target=s.start) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in servers:
            assert s.proc is not None and s.proc.poll() is None, s.log.read_text()
        yield servers


def post(url: str, model: str) -> httpx.Response:
    body = {"type": "response", "input": {"input": "hi", "model": model, "temperature": 0, "max_output_tokens": 4}}
    return httpx.post(f"{url}/lmsp/v1/tasks", json=body, timeout=30)


def rows(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, params).fetchall()


@pytest.mark.slow
def test_a_task_runs_on_a_node_serving_its_model(two: list[Server], pg_url: str) -> None:
    n1, n2 = two
    # n1 does not serve "other": it accepts the task all the same, and only n2 claims it.
    accepted = [post(n1.url, "other") for _ in range(4)]
    assert [r.status_code for r in accepted] == [202] * 4, [r.text for r in accepted]
    for r in accepted:
        done = wait_final(n1.url, r.json()["id"], timeout=120)
        assert done["status"] == "succeeded", done
        assert done["response"]["model"] == "other"
    ran_on = rows(pg_url, "SELECT DISTINCT node, model FROM tasks WHERE model = 'other'")
    assert ran_on == [("n2", "other")]
    # A model no live node serves: refused as on one node, naming the field, nothing written.
    before = rows(pg_url, "SELECT count(*) FROM tasks")
    for url in (n1.url, n2.url):
        r = post(url, "ghost")
        assert r.status_code == 404, r.text
        assert (r.json()["code"], r.json()["param"]) == ("model_not_found", "model")
    assert rows(pg_url, "SELECT count(*) FROM tasks") == before
