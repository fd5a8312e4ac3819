"""A stand-in Messages server that records what the real Claude Code CLI sends (the fixtures
under ``support/data/claude/``).

    python harness/claude_capture.py serve OUT_DIR [--port 18998]
    python harness/claude_capture.py scrub REQ.json OUT.json --home DIR --workspace DIR

Every request, whatever its method and path, is written to ``OUT_DIR/req_<n>.json`` as
``{"method", "path", "headers", "body"}`` (``body`` the decoded JSON, or the raw text, or
null). The replies: ``POST /v1/messages`` a minimal valid message (a stream of its events
under ``stream: true``) that drives one agent step (while the last user message holds no
``tool_result`` and a ``Bash`` tool is offered, a ``tool_use`` of ``Bash`` with ``{"command":
"ls"}``; otherwise the text ``hello``), ``POST /v1/messages/count_tokens`` ``{"input_tokens":
1}``, ``GET /v1/models`` Anthropic's list shape with one model, anything else a 404 in
Anthropic's envelope. ``scrub`` replaces what names the capturing machine (the home and
workspace folders, the session and device ids) by fixed stand-ins. How the fixtures were
made with it: that folder's README.
"""

from __future__ import annotations

import itertools
import json
import re
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from harness import capture


def wants_result(body: dict[str, Any]) -> bool:
    """Whether the reply to ``body`` is a call: a Bash tool offered, no tool result yet."""
    tools = [t.get("name") for t in body.get("tools") or []]
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    content = last.get("content") if isinstance(last, dict) else None
    answered = isinstance(content, list) and any(b.get("type") == "tool_result" for b in content)
    return "Bash" in tools and not answered


def reply(body: dict[str, Any], n: int) -> tuple[dict[str, Any], str]:
    """The one content block of reply ``n`` to ``body``, and its stop reason."""
    if wants_result(body):
        call = {
            "type": "tool_use",
            "id": f"toolu_{n}",
            "name": "Bash",
            "input": {"command": "ls", "description": "List"},
        }
        return call, "tool_use"
    return {"type": "text", "text": "hello"}, "end_turn"


def message(body: dict[str, Any], n: int, *, streamed: bool = False) -> dict[str, Any]:
    """Reply ``n`` as a message (``streamed``: as ``message_start`` carries it, empty)."""
    block, stop = reply(body, n)
    return {
        "id": f"msg_{n}",
        "type": "message",
        "role": "assistant",
        "model": str(body.get("model", "m")),
        "content": [] if streamed else [block],
        "stop_reason": None if streamed else stop,
        "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 0 if streamed else 1},
    }


def events(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Reply ``n`` as Messages stream events."""
    block, stop = reply(body, n)
    if block["type"] == "tool_use":
        start = dict(block, input={})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    else:
        start, delta = dict(block, text=""), {"type": "text_delta", "text": block["text"]}
    end = {"stop_reason": stop, "stop_sequence": None}
    return [
        {"type": "message_start", "message": message(body, n, streamed=True)},
        {"type": "content_block_start", "index": 0, "content_block": start},
        {"type": "content_block_delta", "index": 0, "delta": delta},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": end, "usage": {"output_tokens": 1}},
        {"type": "message_stop"},
    ]


MODELS = {
    "data": [{"type": "model", "id": "tiny", "display_name": "tiny", "created_at": "2026-01-01T00:00:00Z"}],
    "has_more": False,
    "first_id": "tiny",
    "last_id": "tiny",
}


def handler(out_dir: Path) -> type[BaseHTTPRequestHandler]:
    counter = itertools.count()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def record(self) -> tuple[int, Any]:
            raw = self.rfile.read(int(self.headers.get("content-length", 0) or 0))
            body: Any = None
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = raw.decode(errors="replace")
            n = next(counter)
            headers = {k.lower(): v for k, v in self.headers.items()}
            entry = {"method": self.command, "path": self.path, "headers": headers, "body": body}
            (out_dir / f"req_{n}.json").write_text(json.dumps(entry, indent=1, ensure_ascii=False) + "\n")
            return n, body

        def send_json(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def answer(self) -> None:
            n, body = self.record()
            path = self.path.split("?", 1)[0].removeprefix("/v1")
            if self.command == "POST" and path == "/messages" and isinstance(body, dict):
                if not body.get("stream"):
                    self.send_json(200, message(body, n))
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                capture.write_events(self.wfile, events(body, n))
                self.close_connection = True
            elif self.command == "POST" and path == "/messages/count_tokens":
                self.send_json(200, {"input_tokens": 1})
            elif self.command in ("GET", "HEAD") and path == "/models":
                self.send_json(200, MODELS)
            else:
                self.send_json(404, {"type": "error", "error": {"type": "not_found_error", "message": "not found"}})

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


HOME = "/home/user"
WORKSPACE = "/home/user/project"
SESSION = "00000000-0000-4000-8000-000000000000"
DEVICE = "0" * 64
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
DEVICE_ID = re.compile(r'(\\"device_id\\":\\")[0-9a-f]{64}')  # inside metadata.user_id, a JSON string


def scrub(text: str, home: str, workspace: str) -> str:
    """``text`` (a request as ``serve`` wrote it) with the workspace (and its name as Claude
    Code's project folder), the home, every UUID (the session's) and the device id replaced by
    fixed stand-ins."""
    text = text.replace(workspace, WORKSPACE).replace(home, HOME)
    text = text.replace(workspace.replace("/", "-"), WORKSPACE.replace("/", "-"))  # its project folder's name
    return DEVICE_ID.sub(lambda m: m.group(1) + DEVICE, UUID.sub(SESSION, text))


def main() -> None:
    capture.main(port=18998, handler=handler, scrub=scrub, home="--home")


if __name__ == "__main__":
    main()
