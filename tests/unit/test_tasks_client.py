"""``lmspd tasks``: the SSE parser, the resuming event stream and the commands, against a fake
server (httpx.MockTransport) that drops connections, goes down, answers 503 and closes streams
early. The same client against a real server killed with SIGKILL: test_tasks_cli_restart.py."""

from __future__ import annotations

import io
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest

from lmspd.cli.main import COMMANDS, build_parser, main
from lmspd.client.http import ClientError, TaskClient
from lmspd.client.sse import SseEvent, SseParser
from lmspd.client.watch import TaskView, watch

TASK_ID = "task_01TEST"
WORDS = ["Once", " upon", " a", " time", ",", " a", " dragon", " 🐉", " slept", " under", " the", " hill", "."]


def story_events(words: list[str] = WORDS, start_seq: int = 0) -> list[dict[str, Any]]:
    """A response's events as the server writes them: created, in_progress, the item, the deltas, the final."""
    item = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {"status": "queued"}},
        {"type": "response.in_progress", "response": {"status": "in_progress"}},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        *(
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": w,
            }
            for w in words
        ),
        {"type": "response.output_text.done", "text": "".join(words)},
        {
            "type": "response.completed",
            "response": {
                "status": "completed",
                "usage": {"input_tokens": 5, "output_tokens": len(words), "total_tokens": 5 + len(words)},
            },
        },
    ]
    return [{**e, "sequence_number": start_seq + i} for i, e in enumerate(events)]


def frame(event: dict[str, Any]) -> bytes:
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (
        event["sequence_number"],
        event["type"].encode(),
        msgspec.json.encode(event),
    )


@dataclass
class Conn:
    """What one connection to the events endpoint does: serve events up to ``until`` (a sequence
    number, None = to the end) and then ``end`` — "close" (a clean end: a server shutting down),
    "drop" (half of the next frame, then a reset); or fail at once: "refuse", or an HTTP status."""

    until: int | None = None
    end: str = "close"
    status: int = 200
    refuse: bool = False
    replay_from_start: bool = False  # a server that ignores Last-Event-ID (the client must drop duplicates)
    skip: int | None = None  # a server that loses this event (the client must not skip over the gap)


@dataclass
class FakeServer:
    events: list[dict[str, Any]]
    script: list[Conn]
    chunk: int = 7  # bytes per chunk: frames and UTF-8 characters split across reads
    seen_last_event_ids: list[str | None] = field(default_factory=list)
    requests: list[httpx.Request] = field(default_factory=list)

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if not request.url.path.endswith("/events"):
            raise AssertionError(f"unexpected {request.method} {request.url}")
        self.seen_last_event_ids.append(request.headers.get("last-event-id"))
        conn = self.script.pop(0) if self.script else Conn()
        if conn.refuse:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if conn.status != 200:
            problem = {"type": "urn:lmsp:problem:x", "title": "t", "status": conn.status, "code": "x", "detail": "d"}
            return httpx.Response(conn.status, json=problem, headers={"Content-Type": "application/problem+json"})
        raw = request.headers.get("last-event-id")
        after = -1 if raw is None or conn.replay_from_start else int(raw)
        todo = [e for e in self.events if e["sequence_number"] > after and e["sequence_number"] != conn.skip]
        if conn.until is not None:
            todo = [e for e in todo if e["sequence_number"] <= conn.until]
        rest = [e for e in self.events if e["sequence_number"] > (todo[-1]["sequence_number"] if todo else after)]
        body = b"retry: 2000\n\n" + b": keep-alive\n\n".join(frame(e) for e in todo)
        drop = conn.end == "drop" and rest
        if drop:
            body += frame(rest[0])[: len(frame(rest[0])) // 2]

        def stream() -> Iterator[bytes]:
            for i in range(0, len(body), self.chunk):
                yield body[i : i + self.chunk]
            if drop:
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

        return httpx.Response(200, content=stream(), headers={"Content-Type": "text/event-stream"})


def client_for(server: FakeServer, sleeps: list[float] | None = None) -> TaskClient:
    record: Callable[[float], None] = sleeps.append if sleeps is not None else lambda _: None
    return TaskClient("http://lmspd.test", transport=httpx.MockTransport(server.handler), sleep=record)


# --- the SSE parser ---------------------------------------------------------------------------


def test_sse_parser_follows_the_event_stream_rules() -> None:
    parser = SseParser()
    lines = [
        "retry: 1500",
        "",
        ": keep-alive",
        "",
        "id: 3",
        "event: response.output_text.delta",
        'data: {"a":',
        "data:1}",
        "unknown: field",
        "",
        "data: no id or type",  # the last event ID carries over
        "",
        "id: 4",
        "data: cut off",  # the connection drops here: never dispatched
    ]
    out = [e for line in lines if (e := parser.feed(line)) is not None]
    assert out == [
        SseEvent(id="3", event="response.output_text.delta", data='{"a":\n1}'),
        SseEvent(id="3", event="message", data="no id or type"),
    ]
    assert parser.retry_ms == 1500
    assert parser.last_event_id == "4"


# --- the resuming event stream ----------------------------------------------------------------


def test_events_resume_across_drops_restarts_and_early_ends_without_gap_or_duplicate() -> None:
    events = story_events()
    server = FakeServer(
        events,
        [
            Conn(until=6, end="drop"),  # reset mid-frame: half of event 7 was on the wire
            Conn(refuse=True),  # the server is down
            Conn(refuse=True),
            Conn(status=503),  # starting up
            Conn(until=10, end="close"),  # SIGTERM: the stream closes cleanly before the final event
            Conn(replay_from_start=True, until=13, end="drop"),  # replays events already delivered
            Conn(),
        ],
    )
    sleeps: list[float] = []
    reconnects: list[tuple[str, float, int | None]] = []
    client = client_for(server, sleeps)
    got = list(client.events(TASK_ID, on_reconnect=lambda *a: reconnects.append(a)))

    assert got == events  # every event once, in order
    assert server.seen_last_event_ids == [None, "6", "6", "6", "6", "10", "13"]
    assert [r[2] for r in reconnects] == [6, 6, 6, 6, 10, 13]
    assert reconnects[0][0].startswith("connection lost") and reconnects[1][0] == "connection refused"
    assert "503" in reconnects[3][0] and reconnects[4][0] == "the stream ended before the task finished"
    assert sleeps == [0.25, 0.5, 1.0, 2.0, 0.25, 0.25]  # backoff up to the retry: hint, reset by progress


def test_events_start_after_a_given_sequence_number() -> None:
    events = story_events()
    server = FakeServer(events, [Conn(until=8, end="drop")])
    got = list(client_for(server).events(TASK_ID, after=4))
    assert got == events[5:]
    assert server.seen_last_event_ids == ["4", "8"]


def test_a_gap_in_the_stream_is_an_error_not_skipped_over() -> None:
    server = FakeServer(story_events(), [Conn(skip=5)])
    with pytest.raises(ClientError, match="gap: expected 5, got 6"):
        list(client_for(server).events(TASK_ID))


def test_events_give_up_on_a_server_that_stays_down() -> None:
    server = FakeServer(story_events(), [Conn(until=3, end="drop"), *[Conn(refuse=True)] * 50])
    client = client_for(server)
    with pytest.raises(ClientError, match="gave up on the events of task_01TEST after 0s: connection"):
        list(client.events(TASK_ID, give_up_after=0.0))


# --- watch ------------------------------------------------------------------------------------


def test_watch_prints_exactly_the_text_across_dropped_connections() -> None:
    server = FakeServer(story_events(), [Conn(until=5, end="drop"), Conn(refuse=True), Conn(until=9), Conn()])
    out, err = io.StringIO(), io.StringIO()
    assert watch(client_for(server), TASK_ID, out=out, err=err, live=False) == 0
    assert out.getvalue() == "".join(WORDS)
    notices = [re.sub(r"[\d.]+s$", "Xs", line) for line in err.getvalue().splitlines()]
    assert notices == [
        "lmspd: connection lost: peer closed connection without sending complete message body;"
        " reconnecting to resume after event 5",
        "lmspd: connection refused; reconnecting to resume after event 5",
        "lmspd: reconnected after Xs",
        "lmspd: the stream ended before the task finished; reconnecting to resume after event 9",
        "lmspd: reconnected after Xs",
        f"lmspd: {TASK_ID} · completed · {len(WORDS)} tokens · 2 reconnects",
    ]


def test_attempt_restarted_discards_the_accumulated_output() -> None:
    first = story_events(["This", " attempt", " is", " lost"])[:-2]  # cut off by the restart
    restarted = {"type": "lmsp.attempt.restarted", "attempt": 2, "reason": "server_restarted"}
    second = story_events(["A", " fresh", " start"], start_seq=len(first) - 1)[2:]  # from in_progress
    events = [*first, {**restarted, "sequence_number": len(first)}, *second]
    view = TaskView(TASK_ID)
    for e in events:
        view.apply(e)
    assert view.text == "A fresh start" and view.attempt == 2 and view.tokens == 3 and view.succeeded

    out, err = io.StringIO(), io.StringIO()
    assert (
        watch(client_for(FakeServer(events, [Conn(until=4, end="drop")])), TASK_ID, out=out, err=err, live=False) == 0
    )
    assert out.getvalue() == "This attempt is lostA fresh start"  # a pipe cannot take text back...
    assert "attempt 2 started over (server_restarted): discard the output above" in err.getvalue()  # ...so it says so


def test_watch_live_view_ends_with_the_text_and_a_failed_task_exits_1() -> None:
    events = story_events(["Half", " an", " answer"])
    events[-1] = {
        "type": "response.failed",
        "sequence_number": events[-1]["sequence_number"],
        "response": {"status": "failed", "error": {"code": "engine_crashed", "message": "the engine died"}},
    }
    out, err = io.StringIO(), io.StringIO()
    assert watch(client_for(FakeServer(events, [])), TASK_ID, out=out, err=err, live=True) == 1
    assert "Half an answer" in out.getvalue()
    assert "failed" in err.getvalue() and "engine_crashed: the engine died" in err.getvalue()


def test_token_rate_counts_live_deltas_and_leaves_out_reconnect_gaps() -> None:
    view = TaskView(TASK_ID)
    delta = {"type": "response.output_text.delta", "delta": "x"}
    for t in (0.0, 0.1, 0.2, 0.3):  # 3 tokens in 0.3 s after the first
        view.apply(delta, now=t)
    view.disconnected("connection lost")
    for t in (10.0, 10.1, 10.2, 10.3):  # 10 s later, after the reconnect
        view.apply(delta, now=t)
    assert view.rate() == pytest.approx(10.0)
    finished = TaskView(TASK_ID)  # watched after the fact: the replay is instant, the server's clock says
    finished.apply(
        {
            "type": "response.completed",
            "response": {"created_at": 100, "completed_at": 104, "usage": {"output_tokens": 40}},
        }
    )
    assert finished.rate() == 10.0


# --- the commands -----------------------------------------------------------------------------


def task_json(status: str = "queued", **extra: Any) -> dict[str, Any]:
    return {
        "id": TASK_ID,
        "object": "task",
        "type": "response",
        "status": status,
        "created_at": 1_700_000_000,
        "updated_at": 1_700_000_000,
        "response_id": "resp_1",
        "events_url": f"/lmsp/v1/tasks/{TASK_ID}/events",
        "on_restart": "resume",
        "attempt": 1,
        "response": None,
        "error": None,
        **extra,
    }


def problem(status: int, code: str, detail: str) -> httpx.Response:
    body = {"type": f"urn:lmsp:problem:{code}", "title": code, "status": status, "detail": detail, "code": code}
    return httpx.Response(status, json=body, headers={"Content-Type": "application/problem+json"})


def run_cli(argv: list[str], handler: Callable[[httpx.Request], httpx.Response]) -> int:
    args = build_parser().parse_args(argv)
    args.transport = httpx.MockTransport(handler)
    return COMMANDS[(args.command, args.tasks_command)](args)


def test_submit_sends_the_task_and_its_idempotency_key(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(202, json=task_json())

    argv = ["tasks", "submit", "Hi", "--model", "tiny", "--max-output-tokens", "9", "--on-restart", "resume"]
    assert run_cli([*argv, "--idempotency-key", "k1", "--token", "sekrit"], handler) == 0
    assert capsys.readouterr().out == f"{TASK_ID}\n"
    (request,) = seen
    assert (request.method, request.url.path) == ("POST", "/lmsp/v1/tasks")
    assert request.headers["idempotency-key"] == "k1" and request.headers["authorization"] == "Bearer sekrit"
    assert msgspec.json.decode(request.content) == {
        "type": "response",
        "input": {"input": "Hi", "model": "tiny", "max_output_tokens": 9},
        "on_restart": "resume",
    }


def test_submit_watch_list_get_cancel(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMSPD_URL", "http://elsewhere:9000")
    monkeypatch.setenv("LMSPD_TOKEN", "from-env")
    events = story_events()
    fake = FakeServer(events, [Conn(until=7, end="drop")])
    response = {
        "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi!"}]}],
    }
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        assert request.url.host == "elsewhere" and request.headers["authorization"] == "Bearer from-env"
        path = request.url.path
        if path.endswith("/events"):
            return fake.handler(request)
        if request.method == "POST" and path == "/lmsp/v1/tasks":
            return httpx.Response(202, json=task_json())
        if path == "/lmsp/v1/tasks":
            page = {
                "object": "list",
                "data": [task_json("running")],
                "has_more": True,
                "first_id": TASK_ID,
                "last_id": TASK_ID,
            }
            return httpx.Response(200, json=page)
        if path.endswith("/cancel"):
            return httpx.Response(200, json=task_json("cancelling"))
        return httpx.Response(200, json=task_json("succeeded", response=response))

    assert run_cli(["tasks", "submit", "Hi", "--watch"], handler) == 0
    captured = capsys.readouterr()
    assert captured.out == "".join(WORDS)  # stdout is not a terminal: exactly the text
    assert f"lmspd: task {TASK_ID} queued (on_restart resume)" in captured.err
    assert fake.seen_last_event_ids == [None, "7"]

    assert run_cli(["tasks", "list", "--status", "running", "--status", "queued", "--limit", "5"], handler) == 0
    captured = capsys.readouterr()
    assert captured.out.split("\t")[:4] == [TASK_ID, "running", "resume", "1"]
    assert captured.err == f"lmspd: more: --after {TASK_ID}\n"
    assert seen[-1].url.query == b"status=running&status=queued&limit=5"

    assert run_cli(["tasks", "get", TASK_ID], handler) == 0
    assert msgspec.json.decode(capsys.readouterr().out)["status"] == "succeeded"
    assert run_cli(["tasks", "get", TASK_ID, "--text"], handler) == 0
    assert capsys.readouterr().out == "Hi!"
    assert run_cli(["tasks", "cancel", TASK_ID], handler) == 0
    assert capsys.readouterr().out == f"{TASK_ID} cancelling\n"


@pytest.mark.parametrize(
    ("argv", "answer", "message"),
    [
        (
            ["get", "x"],
            problem(401, "unauthorized", "missing or wrong token"),
            "401 unauthorized: missing or wrong token (pass --token or set LMSPD_TOKEN)",
        ),
        (["get", "x"], problem(404, "task_not_found", "no task x"), "404 task_not_found: no task x"),
        (
            ["cancel", "x"],
            problem(409, "task_not_cancelable", "x is succeeded"),
            "409 task_not_cancelable: x is succeeded",
        ),
        (["watch", "x"], problem(410, "event_history_expired", "gone"), "410 event_history_expired: gone (the task's"),
        (["watch", "x"], problem(404, "task_not_found", "no task x"), "404 task_not_found: no task x"),
        (["list"], httpx.Response(500, text="boom"), "500 error: Internal Server Error"),
    ],
)
def test_errors_are_one_line_and_exit_1(
    argv: list[str], answer: httpx.Response, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(["tasks", *argv], lambda _: answer) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"lmspd: error: {message}") and captured.err.count("\n") == 1


@pytest.mark.parametrize("command", [["list"], ["watch", "task_x"], ["submit", "hi", "--watch"]])
def test_a_server_that_is_down_is_one_line_and_exit_1(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["tasks", *command, "--url", url]) == 1
    err = capsys.readouterr().err
    assert err == f"lmspd: error: cannot reach lmspd at {url} (connection refused); is `lmspd serve` running?\n"
