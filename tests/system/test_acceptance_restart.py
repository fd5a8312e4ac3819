"""Acceptance: a real ``lmspd serve`` process is killed with SIGKILL mid-generation and started
again; every accepted task survives and ends as its ``on_restart`` policy says, and ``lmspd tasks
submit --watch``, following one of them, prints exactly its final text."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec
import openai
import pytest

from harness.server import Server, read_sse, task, tiny_server, wait_final
from harness.server import submit as submit_task
from harness.wait import wait_until
from lmspd.cli.tasks import output_text
from lmspd.models.registry import ResolvedModel

PROMPT = "Tell me a long story about a dragon."
# Output tokens per task (greedy on the tiny model: every task runs to this limit). The kill
# comes once the resume task has streamed 40 events, with ~120 tokens per task still to go:
# a margin of many times the few steps between seeing event 40 and the kill, on any machine.
# The test checks below that every task really was caught mid-generation.
MAX_TOKENS = 160
FINALS = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


def submit(url: str, on_restart: str) -> dict[str, Any]:
    return submit_task(url, on_restart, PROMPT, MAX_TOKENS)


@pytest.fixture
def server(tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    with tiny_server(
        tmp_path, model_cache, tiny_long, engine="max_concurrency = 4\n", server="keepalive_secs = 1.0\n"
    ) as srv:
        yield srv


def all_events(url: str, task_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    read_sse(url, task_id, out)
    return out


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


class PipeReader(threading.Thread):
    """Collects a subprocess's pipe; ``ready`` is set once ``pattern`` matches what came so far
    (or the pipe closed: then ``match`` is None)."""

    def __init__(self, pipe: IO[bytes] | None, pattern: bytes) -> None:
        super().__init__(daemon=True)
        assert pipe is not None
        self.pipe, self.pattern = pipe, re.compile(pattern)
        self.data = b""
        self.match: re.Match[bytes] | None = None
        self.ready = threading.Event()
        self.start()

    def run(self) -> None:
        while chunk := os.read(self.pipe.fileno(), 65536):
            self.data += chunk
            if not self.ready.is_set() and (m := self.pattern.search(self.data)):
                self.match = m
                self.ready.set()
        self.ready.set()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Client processes a test starts; killed at the end if a failed test left them running."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def submit_and_watch(
    url: str, procs: list[subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], PipeReader, PipeReader, dict[str, Any]]:
    """``lmspd tasks submit --on-restart resume --watch`` as a person runs it: the task is the one
    ``submit(url, "resume")`` would make. Returns the process, its stdout and stderr, the task."""
    cmd = [sys.executable, "-m", "lmspd.cli", "tasks", "submit", PROMPT, "--url", url, "--on-restart", "resume"]
    cmd += ["--temperature", "0", "--max-output-tokens", str(MAX_TOKENS), "--watch"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(proc)
    out = PipeReader(proc.stdout, rb".")
    err = PipeReader(proc.stderr, rb"lmspd: task (task_\w+) queued \(on_restart resume\)")
    assert err.ready.wait(60) and err.match, err.data.decode()
    return proc, out, err, task(url, err.match.group(1).decode())


@pytest.mark.slow
def test_kill_9_mid_generation_then_restart(server: Server, procs: list[subprocess.Popen[bytes]]) -> None:
    server.start()
    watcher, watched, notices, resume_task = submit_and_watch(server.url, procs)
    tasks = {policy: submit(server.url, policy) for policy in ("fail", "retry")} | {"resume": resume_task}
    to_cancel = submit(server.url, "retry")
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(target=read_sse, args=(server.url, tasks["resume"]["id"], seen), daemon=True)
    reader.start()
    wait_until(lambda: len(seen) >= 40, "generation to get going (40 events)", interval=0.01)
    assert watched.ready.wait(30) and watched.data, notices.data.decode()  # the CLI is printing the text too
    cancel = httpx.post(f"{server.url}/lmsp/v1/tasks/{to_cancel['id']}/cancel", timeout=10)
    assert cancel.status_code == 200
    server.kill9()
    assert watcher.poll() is None  # the CLI waits for the server to come back
    reader.join(10)
    before_kill = list(seen)
    assert not [e for e in before_kill if e["type"] in FINALS]  # the resume task was mid-generation

    server.start()
    url = server.url
    # Every task that got a 202 still exists.
    final = {policy: wait_final(url, t["id"]) for policy, t in tasks.items()}
    assert wait_final(url, to_cancel["id"])["status"] == "cancelled"

    assert final["fail"]["status"] == "failed"
    assert final["fail"]["error"]["code"] == "server_restarted"
    assert final["fail"]["error"]["type"] == "urn:lmsp:problem:server_restarted"

    assert final["retry"]["status"] == "succeeded" and final["retry"]["attempt"] == 2
    retry_events = all_events(url, tasks["retry"]["id"])
    assert [e["sequence_number"] for e in retry_events] == list(range(len(retry_events)))
    restarts = [e for e in retry_events if e["type"] == "lmsp.attempt.restarted"]
    assert len(restarts) == 1 and restarts[0]["attempt"] == 2 and restarts[0]["reason"] == "server_restarted"
    after_restart = retry_events[retry_events.index(restarts[0]) + 1 :]

    assert final["resume"]["status"] == "succeeded" and final["resume"]["attempt"] == 1
    resume_events = all_events(url, tasks["resume"]["id"])
    assert [e["sequence_number"] for e in resume_events] == list(range(len(resume_events)))
    # Nothing a client saw before the kill differs afterwards.
    assert resume_events[: len(before_kill)] == before_kill
    # A client resumes its stream across the restart with no gap and no duplicate.
    tail: list[dict[str, Any]] = []
    read_sse(url, tasks["resume"]["id"], tail, last_event_id=before_kill[-1]["sequence_number"])
    assert before_kill + tail == resume_events
    assert "response.output_text.delta" in {e["type"] for e in tail}  # it went on generating after the restart
    # Resumed text = what was generated before + the continuation = an uninterrupted run.
    reference = wait_final(url, submit(url, "fail")["id"])
    ref_text = reference["response"]["output"][0]["content"][0]["text"]
    assert final["resume"]["response"]["output"][0]["content"][0]["text"] == text_of(resume_events) == ref_text
    assert text_of(after_restart) == ref_text  # the retry started over and ran to the same end
    # The same usage, but for how much of the prompt came from the prompt cache: that depends on
    # what ran before (the reference run finds the prompt cached, the resume task did not).
    resume_usage, reference_usage = final["resume"]["response"]["usage"], reference["response"]["usage"]
    del resume_usage["input_tokens_details"], reference_usage["input_tokens_details"]
    assert resume_usage == reference_usage
    # `lmspd tasks submit --watch` reconnected with Last-Event-ID and printed exactly the final text.
    assert watcher.wait(60) == 0, notices.data.decode()
    watched.join(10)
    notices.join(10)
    assert watched.data.decode() == output_text(final["resume"]["response"]) == ref_text
    assert re.search(rb"lmspd: connection lost.*; reconnecting to resume after event \d+\n", notices.data)
    assert re.search(rb"lmspd: reconnected after [\d.]+s\n", notices.data)
    assert reference["response"]["usage"]["output_tokens"] == MAX_TOKENS  # as long as the margin above says

    assert server.stop() == 0  # SIGTERM: a clean exit


def frames(text_lines: list[str]) -> list[tuple[str | None, str]]:
    """SSE lines as (event, data) frames."""
    out, event = [], None
    for line in text_lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            out.append((event, line[6:]))
            event = None
    return out


def test_a_sigterm_shutdown_ends_every_v1_stream_with_why_and_leaves_its_task_to_its_policy(
    tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel
) -> None:
    """The shutdown ends every stream, which is not the client going away: the responses it
    closes, generating or waiting for a slot, are not cancelled but left for their policy.
    Each /v1 stream says so (an ``error`` event, Chat's error frame), then ``[DONE]``: before,
    half of them ended right after a delta, which an SDK reads as a silent cut. A stored
    response is then read, and its stream resumed, after the restart; an LMSP stream ends as
    it always did (its client resumes with Last-Event-ID)."""
    with tiny_server(tmp_path, model_cache, tiny_long, engine="max_concurrency = 1\n") as server:
        server.start()
        long = {"input": PROMPT, "temperature": 0, "max_output_tokens": MAX_TOKENS, "stream": True}
        bodies = {
            "stored": ("/v1/responses", long),
            "stored2": ("/v1/responses", long),
            "unstored": ("/v1/responses", {**long, "store": False}),
            "chat": (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "stream": True},
            ),
        }
        got: dict[str, list[str]] = {name: [] for name in [*bodies, "sdk", "lmsp"]}
        deltas = threading.Semaphore(0)

        def stream(name: str) -> None:
            route, body = bodies[name]
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream("POST", f"{server.url}{route}", json=body, timeout=60) as r,
            ):
                for line in r.iter_lines():
                    got[name].append(line)
                    if '"response.output_text.delta"' in line or '"chat.completion.chunk"' in line:
                        deltas.release()

        sdk_events: list[Any] = []

        def sdk_stream() -> None:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-no-auth", max_retries=0)
            for event in client.responses.create(**{**long, "stream": True}):  # type: ignore[call-overload]
                sdk_events.append(event)  # ends at [DONE], raising nothing

        readers = [threading.Thread(target=stream, args=(name,), daemon=True) for name in bodies]
        readers.append(threading.Thread(target=sdk_stream, daemon=True))
        for reader in readers:
            reader.start()
        assert deltas.acquire(timeout=60)  # one generates, the others wait for the slot
        lmsp = submit(server.url, "resume")  # queued after them
        lmsp_events: list[dict[str, Any]] = []
        readers.append(threading.Thread(target=read_sse, args=(server.url, lmsp["id"], lmsp_events), daemon=True))
        readers[-1].start()

        def created() -> bool:
            ids = [line for name in bodies if name != "chat" for line in got[name] if '"response.created"' in line]
            chat = any('"chat.completion.chunk"' in line for line in got["chat"])
            return len(ids) == 3 and chat and len(sdk_events) > 0

        def started() -> dict[str, int]:
            return {name: len(lines) for name, lines in got.items()} | {"sdk": len(sdk_events)}

        wait_until(created, lambda: f"every stream started: {started()}", timeout=30, interval=0.01)
        wait_until(lambda: lmsp_events, "the task's stream to start", timeout=30, interval=0.01)
        assert server.stop() == 0
        for reader in readers:
            reader.join(10)
        assert not [r for r in readers if r.is_alive()]
        ends: dict[str, dict[str, Any]] = {}
        for name in bodies:
            seen = frames(got[name])
            assert seen[-1] == (None, "[DONE]"), (name, seen[-3:])
            if name == "chat":
                ends[name] = msgspec.json.decode(seen[-2][1])["error"]
            else:
                assert seen[-2][0] == "error", (name, seen[-3:])
                ends[name] = msgspec.json.decode(seen[-2][1])
                assert ends[name]["sequence_number"] == msgspec.json.decode(seen[-3][1])["sequence_number"]
            assert ends[name]["code"] == "server_shutting_down" and "shutting down" in ends[name]["message"]
        assert sdk_events[-1].type == "error" and sdk_events[-1].code == "server_shutting_down"
        assert "not stored" in ends["unstored"]["message"] and "GET /v1/responses/" in ends["stored"]["message"]
        assert lmsp_events and lmsp_events[-1]["type"] not in FINALS  # cut, as LMSP streams are: resumed by id
        # As the shutdown left them: one started, the others waiting; none cancelled.
        with contextlib.closing(sqlite3.connect(tmp_path / "data" / "lmspd.db")) as db:
            statuses = sorted(db.execute("SELECT status FROM tasks"))
        assert len(statuses) == 6 and all(s in ("queued", "loading", "running") for (s,) in statuses), statuses
        assert any(s in ("loading", "running") for (s,) in statuses), statuses

        server.start()  # the started one fails (server_restarted, its policy), the others run
        for name in ("stored", "stored2"):
            seen = frames(got[name])
            first = msgspec.json.decode(seen[0][1])
            rid, cursor = first["response"]["id"], ends[name]["sequence_number"]
            assert rid in ends[name]["message"] and f"starting_after={cursor}" in ends[name]["message"]
            tail: list[str] = []
            with httpx.stream(
                "GET", f"{server.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": cursor}
            ) as r:
                assert r.status_code == 200
                tail = list(r.iter_lines())
            resumed = frames(tail)
            assert resumed[-1] == (None, "[DONE]") and resumed[-2][0] in FINALS, resumed[-3:]
            numbers = [msgspec.json.decode(d)["sequence_number"] for _, d in [*seen[:-2], *resumed[:-1]]]
            assert numbers == list(range(len(numbers)))  # no gap, no duplicate across the restart
            final = httpx.get(f"{server.url}/v1/responses/{rid}", timeout=10).json()
            assert final["status"] in ("failed", "completed", "incomplete")
            if final["status"] == "failed":
                assert final["error"]["code"] == "server_restarted"
        assert wait_final(server.url, lmsp["id"])["status"] == "succeeded"
