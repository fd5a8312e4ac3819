"""One log line per HTTP request: method, path, status, milliseconds, and the task or
response it concerns. A pure ASGI middleware (it does not buffer streamed responses): the
line is written when the response ends, so an event stream logs its whole duration.
Neither the query string nor the body is logged, so no prompt text is."""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("lmspd.access")
_TASK_PATH = "/lmsp/v1/tasks/"


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0
        location = ""

        async def sending(message: Message) -> None:
            nonlocal status, location
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name == b"location":
                        location = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            status = status or 500  # the error handler answered 500, or nothing was sent
            raise
        finally:
            if log.isEnabledFor(logging.INFO):
                _log(scope, status, (time.perf_counter() - start) * 1000, location)


def _log(scope: Scope, status: int, ms: float, location: str) -> None:
    # The router writes the matched path parameters into the request's scope.
    params: dict[str, Any] = scope.get("path_params") or {}
    fields: dict[str, Any] = {"method": scope["method"], "path": scope["path"], "status": status, "ms": round(ms, 1)}
    task_id = params.get("task_id")
    if task_id is None and location.startswith(_TASK_PATH):  # a task just created
        task_id = location.removeprefix(_TASK_PATH)
    tail = ""
    if task_id is not None:
        fields["task_id"] = task_id
        tail = f" task={task_id}"
    if (response_id := params.get("response_id")) is not None:
        fields["response_id"] = response_id
        tail += f" response={response_id}"
    log.info("%s %s %d %.1fms%s", fields["method"], fields["path"], status, ms, tail, extra=fields)
