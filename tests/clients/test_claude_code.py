"""The real Claude Code CLI (``claude -p``) against a real ``lmspd serve``, run as the README's
"Coding agents" section says: ``ANTHROPIC_BASE_URL`` at the server, any ``ANTHROPIC_API_KEY``
(a tokenless loopback server), ``--model`` one of the server's models and, for an 8k-context
model, ``--tools "Bash,Read,Edit"``. Each run is isolated (``harness.claude.claude_env``: its own
HOME and ``CLAUDE_CONFIG_DIR``, telemetry, updates and nonessential traffic off).

The model is the ``brief`` tiny one with the bundled model's 8k context (``brief_8k``: it ends
its answers by itself after a few tokens, so each of Claude Code's requests costs about a
second). Its random weights never call a tool by themselves, so the tool loop's test gets its
call the way the engine and API tiers do, by grammar: a loopback proxy between Claude Code and
the server (``harness.claude.force_bash``) adds ``tool_choice: {"type": "tool", "name":
"Bash"}`` to the first request, and narrows that request's Bash ``input_schema`` to one constant
command, so lmspd's grammar makes the model call Bash with exactly ``echo lmspd-tool-ok``. Every
other request, the turn carrying Claude Code's own ``tool_result`` included, reaches the server
exactly as Claude Code sent it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.claude import CLAUDE_VERSION, FORCED_COMMAND, claude_binary, force_bash, proxy, run_claude
from harness.clients import require
from harness.models import ROOT
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

SMALL = ["--model", "tiny", "--tools", "Bash,Read,Edit"]


@pytest.fixture(scope="session")
def claude() -> Path:
    """The Claude Code CLI (``@anthropic-ai/claude-code``, the version .ci/run pins); skipped where
    it is missing, except under CI (harness.clients)."""
    what = f"the Claude Code CLI (npm i @anthropic-ai/claude-code@{CLAUDE_VERSION}, or LMSPD_CLAUDE)"
    return require(what, claude_binary())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, brief_8k: ResolvedModel) -> Iterator[Server]:
    with tiny_server(tmp_path_factory.mktemp("claude-8k"), model_cache, brief_8k) as srv:
        srv.start()
        yield srv


def result_of(proc: Any, server: Server) -> dict[str, Any]:
    """The ``result`` object Claude Code printed last (``--output-format json`` or
    ``stream-json``), asserting it is one."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    failure = f"claude exited {proc.returncode}\n{proc.stderr[-3000:]}\n{proc.stdout[-3000:]}\n"
    assert lines, failure + server.log.read_text()[-3000:]
    result = json.loads(lines[-1])
    assert result["type"] == "result", failure
    return dict(result)


def test_print_mode_completes_with_three_tools(claude: Path, server: Server, tmp_path: Path) -> None:
    """The README's one command: exit 0 and a successful result whose text is the model's."""
    proc = run_claude(claude, tmp_path, server.url, ["-p", "Reply with: hello", *SMALL, "--output-format", "json"])
    result = result_of(proc, server)
    assert proc.returncode == 0 and result["subtype"] == "success" and result["is_error"] is False, result
    assert result["terminal_reason"] == "completed" and result["stop_reason"] == "end_turn", result
    assert isinstance(result["result"], str) and result["result"], result
    assert (
        result["usage"]["input_tokens"] + result["usage"]["cache_read_input_tokens"] > 3000
    )  # its ~3,700-token prompt
    assert "POST /v1/messages 200" in server.log.read_text()


def test_a_tool_call_is_run_by_claude_code_and_answered(claude: Path, server: Server, tmp_path: Path) -> None:
    """A ``tool_use`` of Bash (forced by grammar, the module's docstring), run by Claude Code's
    own Bash tool (``--allowedTools`` grants that one command), its ``tool_result`` sent back
    unchanged, and a final answer: the whole agent step, streamed (``stream-json``)."""
    args = ["-p", f"Run this shell command: {FORCED_COMMAND}", *SMALL, "--allowedTools", f"Bash({FORCED_COMMAND})"]
    with proxy(server.url, force_bash) as forcing:
        proc = run_claude(claude, tmp_path, forcing.url, [*args, "--output-format", "stream-json", "--verbose"])
    result = result_of(proc, server)
    assert proc.returncode == 0 and result["subtype"] == "success" and result["is_error"] is False, result
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    blocks = [
        (e["type"], block) for e in events if e["type"] in ("assistant", "user") for block in e["message"]["content"]
    ]
    uses = [b for kind, b in blocks if kind == "assistant" and b["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == [("Bash", {"command": FORCED_COMMAND})], blocks
    results = [b for kind, b in blocks if kind == "user" and b["type"] == "tool_result"]
    assert [r["tool_use_id"] for r in results] == [uses[0]["id"]] and uses[0]["id"].startswith("call_"), blocks
    assert results[0]["is_error"] is False and results[0]["content"].strip() == "lmspd-tool-ok", results
    kinds = [(kind, b["type"]) for kind, b in blocks]
    assert kinds[-1] == ("assistant", "text") and kinds.index(("user", "tool_result")) < len(kinds) - 1, kinds

    posts = [x for x in forcing.exchanges if x.method == "POST"]
    assert [x.status for x in posts] == [200, 200], [(x.status, x.error) for x in posts]  # no retry either
    first, second = posts
    assert first.forwarded is not first.sent and second.forwarded is second.sent  # only the first was forced
    # The second turn, as Claude Code sent it: lmspd's tool_use, then Claude Code's tool_result.
    *_, use_turn, result_turn = second.sent["messages"]
    assert use_turn["role"] == "assistant" and use_turn["content"][-1]["type"] == "tool_use"
    assert use_turn["content"][-1]["id"] == uses[0]["id"]
    answer = [b for b in result_turn["content"] if b["type"] == "tool_result"]
    assert answer and answer[0]["tool_use_id"] == uses[0]["id"]


def test_the_twelve_default_tools_are_too_long_for_an_8k_model(claude: Path, server: Server, tmp_path: Path) -> None:
    """Without ``--tools``, Claude Code's ~12,000-token request is refused in Anthropic's words,
    and Claude Code reports it as what it is (a prompt too long), not as a failure of the server."""
    args = ["-p", "Reply with: hello", "--model", "tiny", "--output-format", "json"]
    proc = run_claude(claude, tmp_path, server.url, args)
    result = result_of(proc, server)
    assert proc.returncode == 1 and result["is_error"] is True, result
    assert result["terminal_reason"] == "prompt_too_long" and result["api_error_status"] == 400, result
    assert "limit 8191" in result["result"], result
    assert "POST /v1/messages 400" in server.log.read_text()


def test_ci_installs_the_claude_code_cli_the_suite_pins() -> None:
    assert f"CLAUDE_VERSION={CLAUDE_VERSION} " in (ROOT / ".ci" / "run").read_text()
