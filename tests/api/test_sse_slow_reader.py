"""A reader too far behind is disconnected, and resumes with Last-Event-ID: no gap, no duplicate.

A real ``lmspd serve`` on loopback (real sockets: backpressure is the kernel's), keep-alive
0.5 s (a reader that takes nothing for 1 s is gone), serving a finished task of 20,000 events
(~4.7 MB of SSE, more than the kernel buffers on loopback) seeded through the store.
``harness/sse_abuse.py`` does the same at scale (1,000 dropped streams, hundreds of slow readers).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncGenerator, Iterator, MutableMapping
from typing import Any

import httpx
import pytest

from harness.history import seed_history
from harness.server import free_port, kill, spawn
from harness.wait import wait_until
from lmspd.api.events import EventStream
from lmspd.models.registry import ResolvedModel

EVENTS = 20000


class Server:
    def __init__(self, pid: int, port: int, task_id: str) -> None:
        self.pid, self.port, self.task_id = pid, port, task_id
        self.url = f"http://127.0.0.1:{port}"
        self.scrapes = httpx.Client(base_url=self.url, timeout=30)  # one kept-alive connection
        self.events = 0  # how many the task has (set by the fixture)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def streams(self) -> float:
        text = self.scrapes.get("/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("lmspd_sse_streams_open"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny: ResolvedModel) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("slow-reader")
    task_id = asyncio.run(seed_history(data / "lmspd.db", EVENTS))
    config = data / "lmspd.toml"
    config.write_text(
        f'default_model = "tiny"\n[engine]\nweight_dtype = "quantized"\n'
        f'[server]\ndata_dir = "{data}"\nkeepalive_secs = 0.5\n[models.tiny]\npath = "{tiny.path}"\n'
    )
    port = free_port()
    cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(config), "--port", str(port)]
    proc = spawn(cmd, f"http://127.0.0.1:{port}/healthz", data / "server.log", timeout=120)
    try:
        found = Server(proc.pid, port, task_id)
        # A reader that keeps up gets the whole stream on one connection.
        ids, text = _read_stream(found, None)
        assert ids == list(range(len(ids))) and len(ids) >= EVENTS - 5
        assert text.rstrip().splitlines()[-2] == "event: response.completed"
        found.events = len(ids)
        yield found
    finally:
        kill(proc, signal.SIGTERM)


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response, as far as it arrived (a cut last chunk kept)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:100]
    body = b""
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        body += rest[:size]
        rest = rest[size + 2 :]
        if size == 0:
            break
    return body


def _ids(body: bytes) -> list[int]:
    """Sequence numbers of the complete events in an SSE body (a cut last one left out)."""
    frames = body.split(b"\n\n")[:-1]  # the text after the last blank line is not a whole event
    return [int(m.group(1)) for frame in frames if (m := re.search(rb"^id: (\d+)$", frame, re.M))]


def _read_stream(server: Server, last_event_id: int | None) -> tuple[list[int], str]:
    headers = {"Connection": "close"}  # else Hypercorn keeps its side until its keep-alive timeout
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    with httpx.stream("GET", f"{server.url}/lmsp/v1/tasks/{server.task_id}/events", headers=headers, timeout=30) as r:
        assert r.status_code == 200
        body = r.read()
    return _ids(body), body.decode()


def test_a_reader_that_never_reads_is_disconnected_and_resumes(server: Server) -> None:
    baseline = server.fds()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(f"GET /lmsp/v1/tasks/{server.task_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    wait_until(lambda: server.fds() > baseline, "the connection accepted", timeout=30, interval=0.05)
    # Not reading: the server's writes block; after two keep-alive intervals it gives up on us
    # (the app ends the stream, and on Linux the kernel drops the socket even while we hold it).
    wait_until(
        lambda: server.fds() <= baseline and server.streams() == 0,
        "the slow reader disconnected",
        timeout=30,
        interval=0.05,
    )
    raw = b""
    sock.settimeout(10)
    try:
        while chunk := sock.recv(1 << 16):
            raw += chunk
    except ConnectionResetError:
        pass  # the kernel reset it: what arrived before still counts
    # (a socket.timeout here would mean the server still held the stream open)
    sock.close()
    received = _ids(_dechunk(raw)) if raw else []
    assert received == list(range(len(received))), "what arrived is a prefix of the log"
    assert len(received) < server.events, "a reader that never read was sent the whole stream"
    # Resume from the last complete event: the rest, no gap, no duplicate, to the final event.
    rest, text = _read_stream(server, received[-1] if received else None)
    assert received + rest == list(range(server.events))
    assert "event: response.completed" in text
    wait_until(
        lambda: server.streams() == 0 and server.fds() <= baseline, "nothing left open", timeout=30, interval=0.05
    )


async def test_an_event_stream_gives_up_on_a_send_that_does_not_finish() -> None:
    """The app's own bound, whatever the platform's sockets do: a write the reader does not take
    within ``stall_secs`` ends the response (no terminating chunk) and closes the event source."""
    closed = asyncio.Event()

    async def source() -> AsyncGenerator[bytes, None]:
        try:
            for i in range(10**6):
                yield b"id: %d\ndata: {}\n\n" % i
        finally:
            closed.set()

    sent: list[dict[str, object]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))
        if len(sent) == 3:  # the reader stops taking anything after two writes
            await asyncio.Event().wait()

    await asyncio.wait_for(EventStream(source(), stall_secs=0.1).stream_response(send), 10)
    assert closed.is_set()
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert all(m.get("more_body") for m in sent[1:]), "no terminating chunk: the reader must see a cut stream"
