"""The mixed load of a chaos run, against one life of the server (until it is killed).

Two submitters create LMSP tasks (``on_restart`` fail, retry or resume) and ``/v1``
background and streaming responses, most with an Idempotency-Key (some sent twice at
once); a create whose answer was lost to a kill is sent again, same key and body, in the
next life. SSE readers follow tasks (``/lmsp/v1/.../events``) and background responses
(``/v1/responses/{id}?stream=true``), drop now and then, and resume with ``Last-Event-ID``,
``?after=`` or ``starting_after``, in the same life or the next. One in ten is cancelled.
Everything a client is told or receives goes into the :class:`Ledger`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

import httpx
import msgspec

from .ledger import FINAL_EVENTS, Ack, Connection, Kind, Ledger, Pending, Policy, Received


class Counts(Protocol):
    """Where the submitters read how many tasks are unfinished (one server's file, or the nodes' database)."""

    def count(self) -> int: ...


async def drain(tasks: Counts, timeout: float) -> None:
    """Until no task is unfinished, or ``timeout`` has passed (the checks then say what is left)."""
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(tasks.count) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


PROMPTS = (
    "Tell me a long story about a dragon.",
    "Describe a lighthouse at night.",
    "Write a poem about the rain in autumn.",
    "Explain how bread is made, step by step.",
)
TOKENS = (8, 32, 96, 200, 300)
# A retry task starts over after each kill: one longer than a life between kills would run
# forever (as documented for ``retry``) and, first in the queue, hold its slots.
RETRY_TOKENS = (8, 32, 96)
POLICIES: tuple[Policy, ...] = ("fail", "retry", "resume")


async def sse(r: httpx.Response) -> AsyncIterator[tuple[str, bytes]]:
    """(event type, data) per frame. Split on bytes: the server ends lines with ``\\n`` only
    and JSON escapes it, while generated text may hold other line separators."""
    buf = b""
    async for chunk in r.aiter_bytes():
        buf += chunk
        while (end := buf.find(b"\n\n")) >= 0:
            frame, buf = buf[:end], buf[end + 2 :]
            kind, data = "", None
            for line in frame.split(b"\n"):
                if line.startswith(b"event: "):
                    kind = line[7:].decode()
                elif line.startswith(b"data: "):
                    data = line[6:]
            if data is not None and data != b"[DONE]":
                yield kind, data


class Load:
    def __init__(
        self,
        ledger: Ledger,
        rng: random.Random,
        server: Counts,
        max_active: int,
        transport: Callable[[], httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        self.ledger, self.rng, self.server, self.max_active = ledger, rng, server, max_active
        self.transport = transport  # --nodes: each life's requests spread over the live nodes
        self.reading: set[str] = set()  # response ids a reader follows now (one reader each)
        self.by_marker: dict[str, str] = {}  # request marker -> the response id it was answered with
        self.made = 0
        self.client: httpx.AsyncClient | None = None
        self.group: asyncio.TaskGroup | None = None
        self.draining = False
        self.stopping = False  # a SIGTERM was sent: 503s and closed streams are expected

    # --- one life of the server -------------------------------------------------------------------

    async def life(self, url: str, *, submit: bool) -> None:
        """Run against the server at ``url``: until cancelled (it was killed), or with
        ``submit`` false (the final, clean run) until every reader got its final event."""
        self.draining, self.stopping = not submit, False
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        timeout = httpx.Timeout(60, connect=5)
        spread = self.transport() if self.transport is not None else None
        async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, transport=spread) as client:
            self.client = client
            async with asyncio.TaskGroup() as group:
                self.group = group
                for pending in list(self.ledger.unanswered.values()):
                    self._spawn(self._create(pending))
                for rid, got in self.ledger.received.items():
                    if not got.final:
                        self._spawn(self._follow(self.ledger.acks[rid]))
                if submit:
                    self._spawn(self._submitter())
                    self._spawn(self._submitter())

    def _spawn(self, job: Coroutine[Any, Any, None]) -> None:
        assert self.group is not None
        self.group.create_task(self._quiet(job))

    async def _quiet(self, job: Coroutine[Any, Any, None]) -> None:
        """A transport error ends a client: the server was killed (the next life resumes its
        work). In the final run nothing kills it, so there it is an error."""
        try:
            await job
        except httpx.TransportError as exc:
            if self.draining:
                self.ledger.errors.append(f"transport error in the final run: {exc!r}")

    @property
    def http(self) -> httpx.AsyncClient:
        assert self.client is not None
        return self.client

    def _unexpected(self, what: str, r: httpx.Response) -> None:
        if r.status_code == 429 or (r.status_code == 503 and self.stopping):
            self.ledger.refused[r.status_code] = self.ledger.refused.get(r.status_code, 0) + 1
        else:
            self.ledger.errors.append(f"{what}: {r.status_code} {r.text[:200]}")

    # --- creating ---------------------------------------------------------------------------------

    async def _submitter(self) -> None:
        while True:
            while await asyncio.to_thread(self.server.count) >= self.max_active:
                await asyncio.sleep(0.2)
            self.made += 1
            marker, roll = f"chaos-{self.made}", self.rng.random()
            body: dict[str, Any] = {
                "input": self.rng.choice(PROMPTS),
                "temperature": 0,
                "max_output_tokens": self.rng.choice(TOKENS),
                "metadata": {"chaos": marker},
            }
            key = f"key-{self.made}" if self.rng.random() < 0.8 else None
            twice = key is not None and self.rng.random() < 0.2
            if roll < 0.6:
                policy = self.rng.choice(POLICIES)
                if policy == "retry":
                    body["max_output_tokens"] = self.rng.choice(RETRY_TOKENS)
                task = {"type": "response", "on_restart": policy, "input": body}
                await self._create(self._pending("task", policy, marker, key, "/lmsp/v1/tasks", task), twice)
            elif roll < 0.8:
                body["background"] = True
                await self._create(self._pending("background", "fail", marker, key, "/v1/responses", body), twice)
            else:
                self._spawn(self._stream(body | {"stream": True}, marker))
            await asyncio.sleep(self.rng.uniform(0.05, 0.5))

    def _pending(self, kind: Kind, policy: Policy, marker: str, key: str | None, path: str, body: Any) -> Pending:
        return Pending(kind, policy, marker, key or "", path, msgspec.json.encode(body))

    async def _create(self, p: Pending, twice: bool = False) -> None:
        """POST it (twice at once if ``twice``: one task either way). With a key it is kept
        until answered, so a create cut off by a kill is sent again in the next life."""
        headers = {"Content-Type": "application/json"}
        if p.key:
            headers["Idempotency-Key"] = p.key
            self.ledger.unanswered[p.key] = p
        self.ledger.requests += 2 if twice else 1
        sends = [self.http.post(p.path, content=p.body, headers=headers) for _ in range(2 if twice else 1)]
        for r in await asyncio.gather(*sends):
            if r.status_code not in (200, 202):
                self._unexpected(f"POST {p.path}", r)
                continue
            obj = r.json()
            rid, task_id = (obj["response_id"], obj["id"]) if p.kind == "task" else (obj["id"], None)
            if r.headers.get("Idempotent-Replayed") == "true":
                self.ledger.replays += 1
            if self.by_marker.setdefault(p.marker, rid) != rid:
                self.ledger.idempotency_faults.append(f"key {p.key}: answered {self.by_marker[p.marker]}, then {rid}")
                continue
            if rid not in self.ledger.acks:
                self.ledger.acks[rid] = Ack(p.kind, rid, task_id, p.policy, p.marker, p.key or None)
                if self.rng.random() < (0.7 if p.kind == "task" else 0.5):
                    self._spawn(self._follow(self.ledger.acks[rid]))
                if self.rng.random() < 0.1:
                    self._spawn(self._cancel(self.ledger.acks[rid], self.rng.uniform(0, 2)))
        self.ledger.unanswered.pop(p.key, None)

    async def _stream(self, body: dict[str, Any], marker: str) -> None:
        """A foreground streaming response: acknowledged by its ``response.created``. Never
        dropped on purpose, as a client going away cancels a foreground response."""
        got: Received | None = None
        conn: Connection | None = None
        self.ledger.requests += 1
        async with self.http.stream("POST", "/v1/responses", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._unexpected("POST /v1/responses (stream)", r)
            try:
                async for kind, data in sse(r):
                    if got is None or conn is None:
                        rid = msgspec.json.decode(data)["response"]["id"]
                        self.ledger.acks[rid] = Ack("stream", rid, None, "fail", marker)
                        self.by_marker[marker] = rid
                        got, conn = self.ledger.receive(rid), Connection(rid, -1)
                        self.ledger.connections.append(conn)
                        self.reading.add(rid)
                    if self._record(got, conn, kind, data):
                        return
            except asyncio.CancelledError:
                # The life ends (--nodes: with the other nodes serving on): this client went away
                # from a live node, which cancels a foreground response, as documented.
                if self.transport is not None and conn is not None:
                    self.ledger.acks[conn.response_id].cancel_sent = True
                raise
            finally:
                if conn is not None:
                    self.reading.discard(conn.response_id)

    # --- reading ----------------------------------------------------------------------------------

    async def _follow(self, ack: Ack) -> None:
        """Read a response's events to its final one, dropping and resuming now and then."""
        rid = ack.response_id
        if rid in self.reading:
            return
        self.reading.add(rid)
        got = self.ledger.receive(rid)
        try:
            while not got.final:
                drop = self.rng.randint(1, 40) if self.rng.random() < 0.3 else None
                if not await self._connect(ack, got, drop):
                    return
                if not got.final:
                    await asyncio.sleep(self.rng.uniform(0, 0.2))
        finally:
            self.reading.discard(rid)

    async def _connect(self, ack: Ack, got: Received, drop: int | None) -> bool:
        """One SSE connection from where the client is; False if it was refused."""
        after = got.last
        headers: dict[str, str] = {}
        if ack.kind == "task":
            url = f"/lmsp/v1/tasks/{ack.task_id}/events"
            if after >= 0 and self.rng.random() < 0.25:
                url += f"?after={after}"
            elif after >= 0:
                headers["Last-Event-ID"] = str(after)
        else:
            url = f"/v1/responses/{ack.response_id}?stream=true"
            if after >= 0:
                url += f"&starting_after={after}"
        conn = Connection(ack.response_id, after)
        self.ledger.connections.append(conn)
        self.ledger.sse_resumes += after >= 0
        self.ledger.requests += 1
        async with self.http.stream("GET", url, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                self._unexpected(f"GET {url} ({headers})", r)
                return False
            n = 0
            async for kind, data in sse(r):
                n += 1
                if self._record(got, conn, kind, data) or (drop is not None and n >= drop):
                    break
        return True

    def _record(self, got: Received, conn: Connection, kind: str, data: bytes) -> bool:
        """Keep what was received; True at the final event. An ``error`` event is no event of
        the log: the server ends a /v1 stream early with one (its sequence_number repeats
        the last event's), and only a shutdown may."""
        if kind == "error":
            code = msgspec.json.decode(data).get("code")
            if not (self.stopping and code == "server_shutting_down"):
                self.ledger.errors.append(f"{conn.response_id}: a stream ended with an error event: {data[:200]!r}")
            return False
        seq = int(msgspec.json.decode(data)["sequence_number"])
        conn.seqs.append(seq)
        got.events.setdefault(seq, (kind, data))
        got.final = got.final or kind in FINAL_EVENTS
        return got.final

    def _final(self, rid: str) -> bool:
        got = self.ledger.received.get(rid)
        return got is not None and got.final

    # --- cancelling -------------------------------------------------------------------------------

    async def _cancel(self, ack: Ack, delay: float) -> None:
        """Cancel it after ``delay`` seconds, unless a reader saw it end first."""
        await asyncio.sleep(delay)
        if self._final(ack.response_id):
            return
        ack.cancel_sent = True
        self.ledger.cancels += 1
        self.ledger.requests += 1
        if ack.kind == "task":
            r = await self.http.post(f"/lmsp/v1/tasks/{ack.task_id}/cancel")
            ack.must_cancel = r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
        else:
            r = await self.http.post(f"/v1/responses/{ack.response_id}/cancel")
            ack.must_cancel = r.status_code == 200 and r.json()["status"] in ("cancelled", "queued", "in_progress")
        if r.status_code not in (200, 409):
            self._unexpected("cancel", r)

    # --- at the end -------------------------------------------------------------------------------

    async def references(self, url: str, prompts: list[str]) -> None:
        """Uninterrupted runs of these inputs (``checks._prompt``), to compare resumed tasks to."""
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for i, prompt in enumerate(prompts):
                text, tokens = msgspec.json.decode(prompt)
                marker = f"ref-{i}"
                body = {"input": text, "temperature": 0, "max_output_tokens": tokens, "metadata": {"chaos": marker}}
                r = await client.post("/lmsp/v1/tasks", json={"type": "response", "on_restart": "fail", "input": body})
                if r.status_code != 202:
                    self._unexpected("POST /lmsp/v1/tasks (reference)", r)
                    continue
                task = r.json()
                self.ledger.acks[task["response_id"]] = Ack("task", task["response_id"], task["id"], "fail", marker)

    async def verify(self, url: str) -> None:
        """Every acknowledged task and response is there for its client too."""
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for ack in self.ledger.acks.values():
                path = f"/lmsp/v1/tasks/{ack.task_id}" if ack.kind == "task" else f"/v1/responses/{ack.response_id}"
                r = await client.get(path)
                if r.status_code != 200:
                    self.ledger.api_missing.append(f"GET {path}: {r.status_code}")
