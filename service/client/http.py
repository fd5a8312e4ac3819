"""A small typed client of the LMSP task API (``/lmsp/v1/tasks``), with an event stream that
survives dropped connections and server restarts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import httpx
import msgspec

from lmspd.client.sse import SseParser

FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})
# Answers that may go away by themselves (a server starting up, a proxy in front of a restart).
TRANSIENT_STATUSES = frozenset({502, 503, 504})

Json = dict[str, Any]
Reconnect = Callable[[str, float, "int | None"], None]  # (why, delay in seconds, last sequence seen)


class ClientError(Exception):
    """One line for a person: what went wrong, with the server's problem ``code`` when it sent one."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


class TaskClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 30.0,
        read_timeout: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)
        # An event stream sends keep-alives at least every 15 s: a read timeout well above that
        # finds a connection whose server vanished without closing it.
        self._stream_timeout = httpx.Timeout(timeout, read=read_timeout)
        self._sleep = sleep

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TaskClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- requests ----------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> Json:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        if r.status_code >= 400:
            raise self._error(r)
        return dict(r.json())

    def submit(
        self,
        prompt: str,
        *,
        model: str | None = None,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        instructions: str | None = None,
        on_restart: str | None = None,
        idempotency_key: str | None = None,
    ) -> Json:
        request: Json = {"input": prompt}
        for key, value in (
            ("model", model),
            ("max_output_tokens", max_output_tokens),
            ("temperature", temperature),
            ("instructions", instructions),
        ):
            if value is not None:
                request[key] = value
        body: Json = {"type": "response", "input": request}
        if on_restart is not None:
            body["on_restart"] = on_restart
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else {}
        return self._request("POST", "/lmsp/v1/tasks", json=body, headers=headers)

    def get(self, task_id: str) -> Json:
        return self._request("GET", f"/lmsp/v1/tasks/{task_id}")

    def list(self, *, statuses: list[str] | None = None, limit: int | None = None, after: str | None = None) -> Json:
        params: list[tuple[str, str | int]] = [("status", s) for s in statuses or []]
        if limit is not None:
            params.append(("limit", limit))
        if after is not None:
            params.append(("after", after))
        return self._request("GET", "/lmsp/v1/tasks", params=params)

    def cancel(self, task_id: str) -> Json:
        return self._request("POST", f"/lmsp/v1/tasks/{task_id}/cancel")

    def models(self) -> Json:
        """``GET /lmsp/v1/models``: ``data`` holds each model with its state (loaded, bytes...)."""
        return self._request("GET", "/lmsp/v1/models")

    def recycle_engine(self) -> Json:
        """``POST /lmsp/v1/engine/recycle``: replace the engine while serving (an operator's call)."""
        return self._request("POST", "/lmsp/v1/engine/recycle")

    def control_model(self, name: str, action: str, *, force: bool = False) -> Json:
        """``POST /lmsp/v1/models/{name}/{action}`` (load, unload, pin, unpin): an operator's call."""
        params = {"force": "true"} if force else {}
        return self._request("POST", f"/lmsp/v1/models/{quote(name, safe='')}/{action}", params=params)

    # --- events ------------------------------------------------------------------------------

    def events(
        self,
        task_id: str,
        after: int | None = None,
        *,
        on_reconnect: Reconnect | None = None,
        give_up_after: float = 300.0,
    ) -> Iterator[Json]:
        """Every event of the task after sequence number ``after`` (all of them by default), in
        order, each exactly once, ending with the final event. A dropped connection, a stream
        closed before the final event (a server shutting down) or a server that is down for a
        while are retried with ``Last-Event-ID`` set to the last event delivered; the retries back
        off from 0.25 s up to the server's ``retry:`` hint, and stop after ``give_up_after`` seconds
        without a new event. A gap in the sequence numbers is an error, never skipped over."""
        last = after
        retry_ms = 2000
        failures = 0
        progress_at = time.monotonic()
        connected = False  # a server that refuses the first connection is down: say so at once
        while True:
            headers = {"Accept": "text/event-stream"}
            if last is not None:
                headers["Last-Event-ID"] = str(last)
            why = "the stream ended before the task finished"
            try:
                with self._http.stream(
                    "GET", f"/lmsp/v1/tasks/{task_id}/events", headers=headers, timeout=self._stream_timeout
                ) as r:
                    connected = True
                    if r.status_code != 200:
                        r.read()
                        error = self._error(r)
                        if r.status_code not in TRANSIENT_STATUSES:
                            raise error
                        raise _Transient(error.message)
                    parser = SseParser()
                    for line in r.iter_lines():
                        sse = parser.feed(line)
                        if parser.retry_ms is not None:
                            retry_ms = parser.retry_ms
                        if sse is None:
                            continue
                        event = _decode(sse.data)
                        seq = event.get("sequence_number")
                        if not isinstance(seq, int):
                            raise ClientError(f"event without a sequence_number: {sse.data[:200]}")
                        if last is not None and seq <= last:
                            continue  # already delivered (a server replaying too much): never twice
                        expected = 0 if last is None else last + 1
                        if seq != expected:
                            raise ClientError(f"event stream of {task_id} has a gap: expected {expected}, got {seq}")
                        last, failures, progress_at = seq, 0, time.monotonic()
                        yield event
                        if event.get("type") in FINAL_EVENTS:
                            return
            except httpx.TransportError as exc:
                if not connected and isinstance(exc, httpx.ConnectError):
                    raise self._unreachable(exc) from exc
                why = _describe(exc)
            except _Transient as exc:
                why = str(exc)
            if time.monotonic() - progress_at > give_up_after:
                raise ClientError(f"gave up on the events of {task_id} after {give_up_after:.0f}s: {why}")
            delay = min(retry_ms / 1000, 0.25 * 2**failures)
            failures += 1
            if on_reconnect is not None:
                on_reconnect(why, delay, last)
            self._sleep(delay)

    # --- errors ------------------------------------------------------------------------------

    def _unreachable(self, exc: httpx.TransportError) -> ClientError:
        return ClientError(f"cannot reach lmspd at {self.url} ({_describe(exc)}); is `lmspd serve` running?")

    def _error(self, r: httpx.Response) -> ClientError:
        code: str | None = None
        detail = r.reason_phrase or "error"
        try:
            body = r.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            code = body.get("code") if isinstance(body.get("code"), str) else None
            detail = str(body.get("detail") or body.get("title") or detail)
        message = f"{r.status_code} {code or 'error'}: {detail}"
        if r.status_code == 401:
            message += " (pass --token or set LMSPD_TOKEN)"
        elif r.status_code == 410:
            message += " (the task's events are past the server's retention window; `lmspd tasks get` still works)"
        return ClientError(message, status=r.status_code, code=code)


class _Transient(Exception):
    pass


def _decode(data: str) -> Json:
    try:
        event = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ClientError(f"malformed event data: {data[:200]}") from exc
    if not isinstance(event, dict):
        raise ClientError(f"malformed event data: {data[:200]}")
    return event


def _describe(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused" if "refused" in str(exc).lower() else f"cannot connect: {exc}"
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    return f"connection lost: {exc or type(exc).__name__}"
