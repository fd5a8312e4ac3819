"""The real Claude Code CLI: where the pinned binary is, an isolated environment to run it in,
the requests it sent (``data/claude/``) and a session built on them, and a loopback proxy that
forces its first call.

Claude Code is the npm package ``@anthropic-ai/claude-code`` (a native binary since 2.x, in the
platform package it depends on); .ci/run installs the version pinned here under the test cache.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from harness import DATA
from harness.capture import pinned_binary
from harness.models import CACHE

CLAUDE_DATA = DATA / "claude"
# The Claude Code CLI the suite pins (npm package @anthropic-ai/claude-code); .ci/run installs it
# under the test cache.
CLAUDE_VERSION = "2.1.332"
CLAUDE_PREFIX = CACHE / "claude" / CLAUDE_VERSION


def claude_binary() -> Path | None:
    """The pinned Claude Code CLI (``LMSPD_CLAUDE``, else the test cache's, else PATH's)."""
    return pinned_binary("claude", "LMSPD_CLAUDE", CLAUDE_PREFIX)


def captured(name: str) -> dict[str, Any]:
    """A captured request (``data/claude/<name>.json``: ``method``, ``path``, ``headers``,
    ``body``), a fresh copy each call."""
    return dict(json.loads((CLAUDE_DATA / f"{name}.json").read_text()))


def claude_env(home: Path, base_url: str) -> dict[str, str]:
    """The environment of an isolated Claude Code run against ``base_url``: its own HOME and
    config folder, no variable of the caller's that Claude Code reads (``ANTHROPIC_*``,
    ``CLAUDE_*``), no telemetry, no update check, no nonessential traffic (nothing beyond
    loopback is reachable here), and a key (a tokenless loopback server takes any)."""
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(
        HOME=str(home),
        CLAUDE_CONFIG_DIR=str(home / ".claude"),
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="sk-local",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    return env


def run_claude(
    claude: Path, tmp: Path, base_url: str, args: list[str], timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``claude <args>`` in a fresh workspace under ``tmp`` (a README.md in it) with
    ``claude_env``, stdin closed."""
    home, work = tmp / "home", tmp / "work"
    for folder in (home, work):
        folder.mkdir(parents=True, exist_ok=True)
    (work / "README.md").write_text("# demo\n")
    return subprocess.run(
        [str(claude), *args],
        cwd=work,
        env=claude_env(home, base_url),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass
class Exchange:
    """One request the proxy forwarded: what the client sent, what was forwarded (the same
    unless rewritten), and the upstream status."""

    method: str
    path: str
    sent: Any
    forwarded: Any
    status: int
    error: Any = None  # the answer's JSON body when the status is not 200


@dataclass
class Proxy:
    """A loopback HTTP proxy to ``upstream`` that hands each JSON request body to ``rewrite``
    (which returns the body to forward: the same object to forward it unchanged) and streams
    each answer back as it comes. ``exchanges`` records every request, in order."""

    upstream: str
    rewrite: Callable[[str, str, Any], Any]
    exchanges: list[Exchange] = field(default_factory=list)
    url: str = ""

    def handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.0 answers: the body ends when the connection closes, so a stream is passed
            # on chunk by chunk without re-framing it.
            protocol_version = "HTTP/1.0"

            def forward(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0) or 0))
                sent: Any = json.loads(raw) if raw else None
                forwarded = proxy.rewrite(self.command, self.path, sent) if sent is not None else None
                if forwarded is not sent:
                    raw = json.dumps(forwarded).encode()
                skip = ("host", "content-length", "connection", "accept-encoding")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                with httpx.stream(
                    self.command, proxy.upstream + self.path, content=raw, headers=headers, timeout=120
                ) as answer:
                    exchange = Exchange(self.command, self.path, sent, forwarded, answer.status_code)
                    proxy.exchanges.append(exchange)
                    if answer.status_code != 200:
                        answer.read()
                        exchange.error = answer.json() if answer.content else None
                    self.send_response(answer.status_code)
                    for key, value in answer.headers.items():
                        if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(key, value)
                    self.end_headers()
                    for chunk in answer.iter_raw() if not answer.is_stream_consumed else [answer.content]:
                        self.wfile.write(chunk)
                        self.wfile.flush()

            do_GET = do_POST = do_HEAD = forward

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


@contextmanager
def proxy(upstream: str, rewrite: Callable[[str, str, Any], Any]) -> Iterator[Proxy]:
    """A running ``Proxy`` on a free loopback port, shut down on exit."""
    found = Proxy(upstream, rewrite)
    server = ThreadingHTTPServer(("127.0.0.1", 0), found.handler())
    found.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


FORCED_COMMAND = "echo lmspd-tool-ok"


def answered(body: dict[str, Any]) -> bool:
    """Whether the last message of a Messages request holds a ``tool_result``."""
    content = body["messages"][-1]["content"]
    return isinstance(content, list) and any(block.get("type") == "tool_result" for block in content)


def force_bash(method: str, path: str, body: Any) -> Any:
    """``Proxy.rewrite`` for a tool loop on a random-weight model: a ``POST /v1/messages``
    that offers ``Bash`` and answers no call yet gets ``tool_choice`` ``{"type": "tool",
    "name": "Bash"}`` and a Bash ``input_schema`` whose ``command`` is the constant
    ``FORCED_COMMAND``, so lmspd's grammar makes the model call ``Bash`` with exactly that
    command. Every other request (the tool result's turn included) is forwarded unchanged."""
    if method != "POST" or not path.split("?")[0].endswith("/messages") or answered(body):
        return body
    tools = body.get("tools") or []
    if not any(tool.get("name") == "Bash" for tool in tools):
        return body
    schema = {
        "type": "object",
        "properties": {"command": {"type": "string", "const": FORCED_COMMAND}},
        "required": ["command"],
        "additionalProperties": False,
    }
    forced = [dict(tool, input_schema=schema) if tool.get("name") == "Bash" else tool for tool in tools]
    return dict(body, tools=forced, tool_choice={"type": "tool", "name": "Bash"})


# A Claude Code session, turn after turn, built on the captured ``three-tools-turn1`` request
# (``--tools "Bash,Read,Edit"``, ~3,700 prompt tokens): bench/agent_session.py ``--messages``.
SESSION_PROMPTS = [
    "What does src/main.py print?",
    "Add a test for it.",
    "Which command runs the tests?",
    "Summarize what you changed.",
    "Anything left to do?",
]
SESSION_TOOL_OUTPUT = "     1\timport sys\n     2\t\n     3\tprint('hello from proj', file=sys.stdout)\n"
_HOP = {"host", "content-length", "connection", "accept-encoding"}


def session_headers() -> dict[str, str]:
    """The headers Claude Code sent with the captured request (less those httpx sets)."""
    sent: dict[str, str] = captured("three-tools-turn1")["headers"]
    return {k: v for k, v in sent.items() if k.lower() not in _HOP}


def session_first() -> list[dict[str, Any]]:
    """Turn 1's messages as Claude Code sent them: the user's two text blocks, then the
    environment as a mid-conversation ``system`` message."""
    messages: list[dict[str, Any]] = captured("three-tools-turn1")["body"]["messages"]
    return messages


def session_body(messages: list[dict[str, Any]], model: str, max_tokens: int) -> dict[str, Any]:
    """A turn's request: the captured body (system blocks with the billing header, tools,
    thinking, effort, context_management, metadata) around the whole conversation. As in the
    captured turn 2, the ``cache_control`` mark moves to the last message's last block and the
    environment message, no longer last, is resent as a plain string."""
    body = captured("three-tools-turn1")["body"]
    marked = copy.deepcopy(messages)
    for message in marked:
        if isinstance(message["content"], list):
            for block in message["content"]:
                block.pop("cache_control", None)
    for message in marked[:-1]:
        if message["role"] == "system" and isinstance(message["content"], list):
            message["content"] = "".join(block["text"] for block in message["content"])
    last = marked[-1]["content"]
    if isinstance(last, list) and last:
        last[-1]["cache_control"] = {"type": "ephemeral"}
    return dict(body, model=model, messages=marked, max_tokens=max_tokens)


def session_next(messages: list[dict[str, Any]], answer: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
    """What Claude Code sends next: the conversation, the answer's content blocks as they came
    (thinking blocks with their signatures), then a ``tool_result`` for each call, or else the
    user's next prompt."""
    out = [*messages, {"role": "assistant", "content": answer}]
    calls = [block for block in answer if block["type"] == "tool_use"]
    if calls:
        results = [{"type": "tool_result", "tool_use_id": c["id"], "content": SESSION_TOOL_OUTPUT} for c in calls]
        out.append({"role": "user", "content": results})
    else:
        text = SESSION_PROMPTS[turn % len(SESSION_PROMPTS)]
        out.append({"role": "user", "content": [{"type": "text", "text": text}]})
    return out
