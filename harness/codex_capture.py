"""A stand-in Responses server that records what a real client sends (the Codex fixtures).

    python harness/codex_capture.py serve OUT_DIR [--port 18999]
    python harness/codex_capture.py scrub REQ.json OUT.json --codex-home DIR --workspace DIR

Each POST body is written to ``OUT_DIR/req_<n>.json`` and its request line and headers to
``OUT_DIR/req_<n>.headers``. The reply is a minimal valid Responses event stream that drives
an agent loop: while the last input item is not a tool's output, a ``reasoning`` item
carrying an opaque ``encrypted_content`` and then a ``function_call`` to ``exec_command``
(``{"cmd": "ls"}``); once the last input item is a ``function_call_output`` (or a custom
tool's output), an assistant message, which ends the turn. ``scrub`` replaces what names
the capturing machine (the Codex home, the workspace, the installation id) by fixed
stand-ins. How the fixtures under ``support/data/codex/`` were made with it: that folder's
README.
"""

from __future__ import annotations

import itertools
import json
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from harness import capture

OPAQUE = "gAAAAB-capture-opaque-reasoning-token-0000"
OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output")


def reply_items(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The output items of reply ``n`` to ``body``."""
    items = body.get("input") or []
    last = items[-1] if isinstance(items, list) and items else {}
    if isinstance(last, dict) and last.get("type") in OUTPUT_TYPES:
        text = "The folder holds the files listed above."
        message = {"type": "message", "id": f"msg_{n}", "status": "completed", "role": "assistant"}
        return [dict(message, content=[{"type": "output_text", "text": text, "annotations": []}])]
    reasoning = {
        "type": "reasoning",
        "id": f"rs_{n}",
        "summary": [{"type": "summary_text", "text": "List the folder first."}],
        "encrypted_content": f"{OPAQUE}{n}",
    }
    call = {
        "type": "function_call",
        "id": f"fc_{n}",
        "status": "completed",
        "call_id": f"call_{n}",
        "name": "exec_command",
        "arguments": json.dumps({"cmd": "ls"}),
    }
    return [reasoning, call]


def events(body: dict[str, Any], n: int) -> list[dict[str, Any]]:
    response: dict[str, Any] = {
        "id": f"resp_{n}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": str(body.get("model", "m")),
        "output": [],
    }
    out: list[dict[str, Any]] = [{"type": "response.created", "response": response}]
    done = reply_items(body, n)
    for index, item in enumerate(done):
        added = dict(item, status="in_progress")
        if item["type"] == "message":
            added["content"] = []
        if item["type"] == "function_call":
            added["arguments"] = ""
        out.append({"type": "response.output_item.added", "output_index": index, "item": added})
        if item["type"] == "message":
            text = item["content"][0]["text"]
            delta = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(dict(delta, type="response.output_text.delta", delta=text))
            out.append(dict(delta, type="response.output_text.done", text=text))
        if item["type"] == "function_call":
            delta = {"item_id": item["id"], "output_index": index}
            out.append(dict(delta, type="response.function_call_arguments.delta", delta=item["arguments"]))
            out.append(dict(delta, type="response.function_call_arguments.done", arguments=item["arguments"]))
        out.append({"type": "response.output_item.done", "output_index": index, "item": item})
    usage = {
        "input_tokens": 1,
        "output_tokens": 1,
        "total_tokens": 2,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    out.append({"type": "response.completed", "response": dict(response, status="completed", output=done, usage=usage)})
    return [dict(e, sequence_number=i) for i, e in enumerate(out)]


def handler(out_dir: Path) -> type[BaseHTTPRequestHandler]:
    counter = itertools.count()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            (out_dir / f"get_{next(counter)}.txt").write_text(f"{self.path}\n{self.headers}")
            self.send_response(404)
            self.end_headers()

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length", 0)))
            n = next(counter)
            (out_dir / f"req_{n}.json").write_bytes(raw)
            (out_dir / f"req_{n}.headers").write_text(f"{self.path}\n{self.headers}")
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            capture.write_events(self.wfile, events(json.loads(raw), n))

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


HOME = "/home/user/.codex"
WORKSPACE = "/home/user/project"
INSTALLATION = "00000000-0000-4000-8000-000000000000"


def scrub(text: str, codex_home: Path, workspace: str) -> str:
    installation = codex_home / "installation_id"
    if installation.exists():
        text = text.replace(installation.read_text().strip(), INSTALLATION)
    return text.replace(str(codex_home), HOME).replace(workspace, WORKSPACE)


def main() -> None:
    def scrub_text(text: str, home: str, workspace: str) -> str:
        return scrub(text, Path(home), workspace)

    capture.main(port=18999, handler=handler, scrub=scrub_text, home="--codex-home")


if __name__ == "__main__":
    main()
