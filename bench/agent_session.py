"""A whole coding-agent session against a real ``lmspd serve``: does the prompt cache hold on
every turn? Codex CLI's on the Responses API (issue 22), or with ``--messages`` Claude Code's on
the Messages API (issue 42).

    python -m bench.agent_session [--messages] [--turns 5] [--restart-before 5] [--tokens 24]
                                  [--model M | --thinker] [--strip]

Codex CLI runs with ``store: false`` and resends its whole history on every request. Turn 1 is
the request Codex 0.171.0 sent on its second round trip, configured as the README says for an
8k-context model (``harness/data/codex/multi-agent-off-turn2.json``: its ~6.5k-token
prompt with 7 function tools, ``client_metadata``, ``include: ["reasoning.encrypted_content"]``,
``prompt_cache_key``, then a reasoning item, a ``function_call`` to ``exec_command`` and its
``function_call_output``; the reasoning item's token, which the capture stand-in wrote, is
replayed as ``null``). Each later turn resends that whole input plus everything the server
answered (its reasoning items with the ``encrypted_content`` it sealed, its calls, its
messages) plus what Codex would add next: a ``function_call_output`` for each call, or else a
new user message. Before turn ``--restart-before`` the server and its engine are killed with
SIGKILL (once the previous turn's cache is on disk) and started again on the same data
directory.

Prints per turn: prompt tokens, cached tokens, time to first token (request sent → the
first delta of any output item) and its ratio to turn 1's (goal ≤ 0.1 from turn 2 on,
the turn after the restart included). Greedy; the server's ``default_max_output_tokens`` is
``--tokens`` (Codex sends no output budget). Bundled model unless ``--model``. The bundled
model does not reason, so its answers carry no reasoning items: ``--thinker`` runs the session
on the tests' tiny ``hermes_think`` model instead (random weights, a 16k context, a template
that opens a reasoning block), whose every answer is a reasoning item with the
``encrypted_content`` the server sealed, replayed on the next turn. Its prefill is too cheap for
the ratio to mean much; its cached tokens say whether the replayed reasoning matched.

``--strip`` leaves out what a server without Codex's request surface refuses
(``client_metadata``, ``include``, ``prompt_cache_key``, reasoning items'
``encrypted_content``, the ``id`` of Codex's ``function_call_output`` items): only to compare
against such a server.

``--messages``: Claude Code's session instead: streamed ``POST /v1/messages?beta=true``, turn 1
the request Claude Code 2.1.332 sent under ``--tools "Bash,Read,Edit"`` as captured
(``harness/data/claude/three-tools-turn1.json``: ~3,700 prompt tokens, the billing header
and two ``cache_control`` system blocks, a user message and the environment as a
mid-conversation ``system`` message, Bash, Read, Edit and a deferred placeholder, adaptive
thinking with ``display: "omitted"``, ``effort: high``, ``context_management``,
``metadata.user_id``). Each later turn resends it all, as the captured turn 2 does (the
``cache_control`` mark moved to the last block), plus the answer's content blocks as they came
(thinking blocks with their signatures) and a ``tool_result`` for each call, or else the user's
next prompt. Time to first token there: request sent → the first ``content_block_start`` (a text
block opens with its first text, a thinking block when the reasoning starts). Cached: the
usage's ``cache_read_input_tokens``; prompt: that plus ``input_tokens``. Claude Code's
``max_tokens: 32000`` would let a turn write until the context is full; the session's
``max_tokens`` is ``--max-tokens``, 24 by default as the Codex session's ``--tokens``.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from harness import claude, codex
from harness.server import kill, serve
from lmspd.config import load_config
from lmspd.engine.prompt_cache import stored_lengths

ROOT = Path(__file__).resolve().parent.parent

LS_OUTPUT = (
    "Chunk ID: 4f1c2a\nWall time: 0.0000 seconds\nProcess exited with code 0\n"
    "Original token count: 4\nOutput:\nREADME.md\nsrc\n"
)
QUESTIONS = claude.SESSION_PROMPTS  # the user's next messages, the same in both sessions


@dataclass
class Turn:
    prompt: int
    cached: int
    output: int
    ttft: float
    answer: list[dict[str, Any]]  # what the client replays: Responses output items, or content blocks
    replayed: int  # reasoning items (thinking blocks) in this turn's request carrying their seal

    def kinds(self) -> str:
        return ", ".join(item["type"] for item in self.answer)


def events(url: str, payload: dict[str, Any], headers: dict[str, str]) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST ``payload`` to ``url`` and yield each SSE ``data:`` event, decoded, with the seconds
    since the request was sent."""
    start = time.perf_counter()
    with httpx.stream("POST", url, json=payload, headers=headers, timeout=1800) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{r.status_code}: {r.text}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield time.perf_counter() - start, json.loads(line[6:])


class Client(Protocol):
    reasoning: str  # what the client calls the sealed reasoning it replays

    def first(self) -> list[dict[str, Any]]: ...
    def turn(self, url: str, model: str, history: list[dict[str, Any]], n: int) -> Turn: ...
    def next(self, history: list[dict[str, Any]], answer: list[dict[str, Any]], n: int) -> list[dict[str, Any]]: ...


def strip(payload: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(payload)
    for key in ("client_metadata", "include", "prompt_cache_key"):
        out.pop(key, None)
    for item in out["input"]:
        if item.get("type") == "reasoning":
            item.pop("encrypted_content", None)
        if item.get("type") == "function_call_output":
            item.pop("id", None)
    return out


@dataclass
class Codex:
    """Codex CLI on /v1/responses: ``store: false``, the whole input resent."""

    stripped: bool = False
    reasoning: str = "reasoning tokens"

    def first(self) -> list[dict[str, Any]]:
        return codex.without_reasoning_tokens(codex.body("multi-agent-off-turn2")["input"])

    def turn(self, url: str, model: str, history: list[dict[str, Any]], n: int) -> Turn:
        payload = dict(codex.body("multi-agent-off-turn2"), input=history, model=model)
        sent = strip(payload) if self.stripped else payload
        reasoning = sum(1 for i in sent["input"] if i.get("type") == "reasoning" and i.get("encrypted_content"))
        first = 0.0
        final: dict[str, Any] | None = None
        for at, event in events(f"{url}/v1/responses", sent, codex.headers()):
            if event["type"].endswith(".delta") and not first:
                first = at
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final, last = event["response"], at
        if final is None or final["status"] == "failed":
            raise RuntimeError(f"the turn did not finish: {final}")
        usage = final["usage"]
        return Turn(
            prompt=usage["input_tokens"],
            cached=usage["input_tokens_details"]["cached_tokens"],
            output=usage["output_tokens"],
            ttft=first or last,
            answer=list(final["output"]),
            replayed=reasoning,
        )

    def next(self, history: list[dict[str, Any]], answer: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
        """What Codex sends next: the history, the server's output, then the calls' outputs or,
        when the model answered with a message, the user's next message."""
        out = [*history, *answer]
        calls = [item for item in answer if item["type"] == "function_call"]
        for call in calls:
            out.append({"type": "function_call_output", "call_id": call["call_id"], "output": LS_OUTPUT})
        if not calls:
            text = QUESTIONS[n % len(QUESTIONS)]
            out.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
        return out


@dataclass
class ClaudeCode:
    """Claude Code on /v1/messages?beta=true: the whole conversation resent."""

    max_tokens: int = 24
    reasoning: str = "thinking blocks"

    def first(self) -> list[dict[str, Any]]:
        return claude.session_first()

    def turn(self, url: str, model: str, history: list[dict[str, Any]], n: int) -> Turn:
        payload = claude.session_body(history, model, self.max_tokens)
        thinking = sum(
            1
            for m in history
            if isinstance(m["content"], list)
            for b in m["content"]
            if b["type"] == "thinking" and b["signature"]
        )
        first = 0.0
        blocks: dict[int, dict[str, Any]] = {}
        json_input: dict[int, str] = {}
        usage: dict[str, Any] | None = None
        for at, event in events(f"{url}/v1/messages?beta=true", payload, claude.session_headers()):
            kind = event["type"]
            if kind == "content_block_start":
                first = first or at
                blocks[event["index"]] = dict(event["content_block"])
            elif kind == "content_block_delta":
                block, delta = blocks[event["index"]], event["delta"]
                if delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] += delta["thinking"]
                elif delta["type"] == "signature_delta":
                    block["signature"] += delta["signature"]
                elif delta["type"] == "input_json_delta":
                    json_input[event["index"]] = json_input.get(event["index"], "") + delta["partial_json"]
            elif kind == "message_delta":
                usage = event["usage"]
            elif kind == "error":
                raise RuntimeError(f"the turn failed: {event['error']}")
            last = at
        if usage is None:
            raise RuntimeError("the stream ended without its message_delta")
        for index, text in json_input.items():
            blocks[index]["input"] = json.loads(text or "{}")
        return Turn(
            prompt=usage["input_tokens"] + usage["cache_read_input_tokens"],
            cached=usage["cache_read_input_tokens"],
            output=usage["output_tokens"],
            ttft=first or last,
            answer=[blocks[i] for i in sorted(blocks)],
            replayed=thinking,
        )

    def next(self, history: list[dict[str, Any]], answer: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
        return claude.session_next(history, answer, n)


def thinker_model(dest: Path) -> Path:
    """The tests' tiny hermes_think model (harness/families.py) with a 16k context."""
    from harness.families import make_family_tokenizer
    from harness.models import CACHE, SMOL, make_tiny_model
    from lmspd.models.pull import pull_builtin

    smol = pull_builtin(SMOL, CACHE / "models")  # instant once the test suite has pulled it
    tokenizer = make_family_tokenizer(dest.with_name(dest.name + "-tok"), smol, "hermes_think")
    return make_tiny_model(dest, tokenizer, seed=0, context=16384)


def main(argv: list[str] | None = None) -> list[Turn]:
    """Run the session, printing each turn; its turns."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", action="store_true", help="Claude Code's session on /v1/messages")
    parser.add_argument("--model", default=None)
    parser.add_argument("--model-path", default=None, help="serve this model directory as --model (default 'local')")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--restart-before", type=int, default=5, help="kill -9 and restart before this turn (0: never)")
    parser.add_argument("--tokens", type=int, default=24, help="the server's default_max_output_tokens")
    parser.add_argument("--max-tokens", type=int, default=24, help="--messages: the requests' max_tokens")
    parser.add_argument("--thinker", action="store_true", help="the tests' tiny reasoning model")
    parser.add_argument("--strip", action="store_true", help="leave out the fields of Codex's request surface")
    args = parser.parse_args(argv)
    base = load_config()
    model = "thinker" if args.thinker else args.model or ("local" if args.model_path else base.default_model)
    client: Client = ClaudeCode(args.max_tokens) if args.messages else Codex(args.strip)
    with tempfile.TemporaryDirectory(prefix="lmspd-bench-agent-") as tmp:
        work = Path(tmp)
        config = (
            f'cache_dir = "{base.model_cache_dir}"\n'
            f'[server]\ndata_dir = "{work}"\ndefault_max_output_tokens = {args.tokens}\n'
        )
        if args.thinker:
            config += f'[models.thinker]\npath = "{thinker_model(work / "thinker")}"\n'
        if args.model_path:  # served as the default: the bundled model is never pulled
            config = f'default_model = "{model}"\n{config}[models.{model}]\npath = "{args.model_path}"\n'

        proc: subprocess.Popen[bytes]
        proc, url = serve(work, config)
        rows: list[Turn] = []
        history = client.first()
        try:
            for n in range(1, args.turns + 1):
                if n == args.restart_before and rows:
                    last = rows[-1]
                    deadline = time.monotonic() + 120
                    # The previous turn's cache is written once the engine is idle: kill only after that.
                    while (
                        max(stored_lengths(work / "prompt-cache"), default=0) < last.prompt
                        and time.monotonic() < deadline
                    ):
                        time.sleep(0.1)
                    kill(proc, signal.SIGKILL)  # the server and its engine, as a power cut would
                    proc, url = serve(work, config)
                    print("-- lmspd serve killed with SIGKILL and started again --", flush=True)
                row = client.turn(url, model, history, n)
                rows.append(row)
                ratio = row.ttft / rows[0].ttft
                print(
                    f"turn {n}: {row.prompt} prompt tokens, {row.cached} cached, time to first token "
                    f"{row.ttft:.2f} s, {ratio:.3f} of turn 1; {row.output} output tokens "
                    f"({row.kinds()}); {row.replayed} {client.reasoning} replayed",
                    flush=True,
                )
                history = client.next(history, row.answer, n)
        finally:
            kill(proc, signal.SIGKILL)
        print()
        worst = max((r.ttft / rows[0].ttft for r in rows[1:]), default=0.0)
        print(f"worst turn 2..{len(rows)} time to first token / turn 1: {worst:.3f} (goal <= 0.1)")
    return rows


if __name__ == "__main__":
    main()
