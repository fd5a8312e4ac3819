"""Acceptance (docs/operations.md, "Several nodes"): three real ``lmspd serve`` nodes on loopback
on one real PostgreSQL, the tiny random-weight model. Not in the default run (pyproject
testpaths): ``.ci/run`` runs this folder in a bounded step of its own (docs/testing.md).

1. Kill -9 a node mid-generation: its tasks of each policy end as the policy says, settled by a
   survivor once its lease expires; the resumed text equals an uninterrupted greedy run; event
   sequences are gap-free; a stream followed on another node sees it all live, and resumes
   with Last-Event-ID on a third; a cancel accepted on another node stops a generation.
2. SIGSTOP a node mid-generation past its lease: a survivor takes its task over and finishes
   it; the paused node, resumed, writes nothing into it (its text stays the uninterrupted
   one) and joins again under a new lease epoch.

Which node runs what is made certain, not left to chance: the other nodes are paused (SIGSTOP)
while the tasks are submitted, so the node under test claims them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from harness.server import Server, read_sse, submit, task, tiny_server, wait_final
from harness.wait import wait_until
from lmspd.models.registry import ResolvedModel

PROMPT = "Tell me a long story about a dragon."
# The kill (or pause) comes at 40 events, with ~360 tokens per task still to go: a margin of many
# times the steps taken meanwhile (a cancel on another node and its settling come first).
MAX_TOKENS = 400
LEASE_SECS = 3.0
FINALS = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


@pytest.fixture
def nodes(tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel, pg_url: str) -> Iterator[list[Server]]:
    with contextlib.ExitStack() as stack:
        servers = []
        for name in ("n1", "n2", "n3"):
            (tmp_path / name).mkdir()
            cluster = f'[store]\nurl = "{pg_url}"\n[cluster]\nnode_id = "{name}"\nheartbeat_secs = 0.5\n'
            cluster += f"lease_secs = {LEASE_SECS}\n"
            servers.append(
                stack.enter_context(
                    tiny_server(
                        tmp_path / name,
                        model_cache,
                        tiny_long,
                        engine="max_concurrency = 8\n",
                        server="keepalive_secs = 1.0\n",
                        responses=cluster,  # the last section of the file: the cluster's follow it
                    )
                )
            )
        threads = [threading.Thread(target=s.start) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in servers:
            assert s.proc is not None and s.proc.poll() is None, s.log.read_text()
        yield servers
        for s in servers:  # a paused node must not outlive the test
            if s.proc is not None and s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)


def pause(server: Server) -> None:
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)


def resume(server: Server) -> None:
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGCONT)


def rows(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, params).fetchall()


def node_of(url: str, task_id: str) -> str | None:
    found = rows(url, "SELECT node FROM tasks WHERE id = %s", task_id)
    return found[0][0] if found else None


def all_events(url: str, task_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    read_sse(url, task_id, out)
    return out


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def final_text(found: dict[str, Any]) -> str:
    return str(found["response"]["output"][0]["content"][0]["text"])


def follow(url: str, task_id: str, seen: list[dict[str, Any]]) -> threading.Thread:
    reader = threading.Thread(target=read_sse, args=(url, task_id, seen), daemon=True)
    reader.start()
    return reader


@pytest.mark.slow
def test_kill_9_a_node_mid_generation(nodes: list[Server], pg_url: str) -> None:
    a, b, c = nodes
    reference = final_text(wait_final(a.url, submit(a.url, "fail", PROMPT, MAX_TOKENS)["id"]))
    # b and c paused: a claims every task, certainly.
    pause(b)
    pause(c)
    tasks = {policy: submit(a.url, policy, PROMPT, MAX_TOKENS) for policy in ("fail", "retry", "resume")}
    to_cancel = submit(a.url, "retry", PROMPT, 4 * MAX_TOKENS)
    seen: list[dict[str, Any]] = []
    reader = follow(a.url, tasks["resume"]["id"], seen)
    wait_until(lambda: len(seen) >= 40, "generation to get going (40 events)", interval=0.01)
    assert {node_of(pg_url, t["id"]) for t in [*tasks.values(), to_cancel]} == {"n1"}
    resume(b)
    resume(c)
    # A cancel accepted on b stops the generation running on a.
    cancel = httpx.post(f"{b.url}/lmsp/v1/tasks/{to_cancel['id']}/cancel", timeout=10)
    assert cancel.status_code == 200, (cancel.text, task(a.url, to_cancel["id"]))
    assert wait_final(b.url, to_cancel["id"])["status"] == "cancelled"
    # A stream of a's task followed on b, live, from what a's stream showed.
    on_b: list[dict[str, Any]] = []
    shown = list(seen)
    follower = threading.Thread(
        target=read_sse, args=(b.url, tasks["resume"]["id"], on_b, shown[-1]["sequence_number"]), daemon=True
    )
    follower.start()
    a.kill9()
    reader.join(10)
    before_kill = list(seen)
    assert not [e for e in before_kill if e["type"] in FINALS]  # it was caught mid-generation

    # A survivor settles a's tasks once a's lease expires, each by its policy.
    final = {policy: wait_final(c.url, t["id"], timeout=120) for policy, t in tasks.items()}
    assert final["fail"]["status"] == "failed" and final["fail"]["error"]["code"] == "server_restarted"
    assert final["retry"]["status"] == "succeeded" and final["retry"]["attempt"] == 2
    retry_events = all_events(c.url, tasks["retry"]["id"])
    assert [e["sequence_number"] for e in retry_events] == list(range(len(retry_events)))
    [restart] = [e for e in retry_events if e["type"] == "lmsp.attempt.restarted"]
    assert text_of(retry_events[retry_events.index(restart) + 1 :]) == reference

    assert final["resume"]["status"] == "succeeded" and final["resume"]["attempt"] == 1
    resume_events = all_events(c.url, tasks["resume"]["id"])
    assert [e["sequence_number"] for e in resume_events] == list(range(len(resume_events)))
    assert resume_events[: len(before_kill)] == before_kill
    assert final_text(final["resume"]) == text_of(resume_events) == reference
    # The follower on b saw the rest live, across the take-over, with no gap and no duplicate.
    follower.join(60)
    assert shown + on_b == resume_events
    assert "response.output_text.delta" in {e["type"] for e in on_b}
    # Nothing of a's is left unsettled, and a's lease is gone.
    assert rows(pg_url, "SELECT count(*) FROM tasks WHERE node = 'n1' AND finished_at IS NULL") == [(0,)]
    assert rows(pg_url, "SELECT count(*) FROM nodes WHERE id = 'n1'") == [(0,)]


@pytest.mark.slow
def test_a_paused_node_writes_nothing_into_the_task_it_lost(nodes: list[Server], pg_url: str) -> None:
    a, b, c = nodes
    reference = final_text(wait_final(b.url, submit(b.url, "fail", PROMPT, MAX_TOKENS)["id"]))
    pause(b)
    pause(c)
    job = submit(a.url, "resume", PROMPT, MAX_TOKENS)
    seen: list[dict[str, Any]] = []
    follow(a.url, job["id"], seen)
    wait_until(lambda: len(seen) >= 40, "generation to get going (40 events)", interval=0.01)
    [(epoch_before,)] = rows(pg_url, "SELECT epoch FROM nodes WHERE id = 'n1'")
    resume(b)
    resume(c)
    pause(a)  # mid-generation, for longer than its lease
    try:
        taken = wait_final(b.url, job["id"], timeout=120)
        assert taken["status"] == "succeeded" and node_of(pg_url, job["id"]) in ("n2", "n3")
    finally:
        resume(a)
    # a comes back: it finds its lease taken over, stops, and joins again under a new epoch.
    wait_until(
        lambda: rows(pg_url, "SELECT epoch FROM nodes WHERE id = 'n1'") not in ([], [(epoch_before,)]),
        "the paused node to join again",
        timeout=60,
    )
    assert "was taken over by another node" in a.log.read_text()
    assert wait_until(lambda: a.ready(), "the paused node to serve again", timeout=30)
    events = all_events(a.url, job["id"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert text_of(events) == final_text(task(c.url, job["id"])) == reference  # nothing of a's stale run in it
    assert events[: len(seen)] == seen[: len(events)]
