"""A whole Codex-shaped agent session against a real ``lmspd serve``: does the prompt cache hold
on every turn (issue 22)?

    python -m bench.agent_session [--turns 5] [--restart-before 5] [--tokens 24] [--model M | --thinker] [--strip]

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
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from harness.codex import body, headers, without_reasoning_tokens
from harness.server import kill, serve
from lmspd.config import load_config
from lmspd.engine.prompt_cache import stored_lengths

ROOT = Path(__file__).resolve().parent.parent

LS_OUTPUT = (
    "Chunk ID: 4f1c2a\nWall time: 0.0000 seconds\nProcess exited with code 0\n"
    "Original token count: 4\nOutput:\nREADME.md\nsrc\n"
)
QUESTIONS = [
    "What does src/main.py print?",
    "Add a test for it.",
    "Which command runs the tests?",
    "Summarize what you changed.",
    "Anything left to do?",
]


@dataclass
class Turn:
    prompt: int
    cached: int
    output: int
    ttft: float
    items: list[dict[str, Any]]  # the response's output, as Codex replays it
    reasoning_sent: int  # reasoning items in this turn's input carrying a token


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


def turn(url: str, model: str, payload: dict[str, Any], stripped: bool) -> Turn:
    payload = dict(payload, model=model)
    sent = strip(payload) if stripped else payload
    reasoning = sum(1 for i in sent["input"] if i.get("type") == "reasoning" and i.get("encrypted_content"))
    start = time.perf_counter()
    first = 0.0
    final: dict[str, Any] | None = None
    with httpx.stream("POST", f"{url}/v1/responses", json=sent, headers=headers(), timeout=1800) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{r.status_code}: {r.text}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["type"].endswith(".delta") and not first:
                first = time.perf_counter() - start
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    if final is None or final["status"] == "failed":
        raise RuntimeError(f"the turn did not finish: {final}")
    usage = final["usage"]
    return Turn(
        prompt=usage["input_tokens"],
        cached=usage["input_tokens_details"]["cached_tokens"],
        output=usage["output_tokens"],
        ttft=first or (time.perf_counter() - start),
        items=list(final["output"]),
        reasoning_sent=reasoning,
    )


def next_input(history: list[dict[str, Any]], answered: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """What Codex sends next: the history, the server's output, then the calls' outputs or,
    when the model answered with a message, the user's next message."""
    out = [*history, *answered]
    calls = [item for item in answered if item["type"] == "function_call"]
    for call in calls:
        out.append({"type": "function_call_output", "call_id": call["call_id"], "output": LS_OUTPUT})
    if not calls:
        text = QUESTIONS[n % len(QUESTIONS)]
        out.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    return out


def thinker_model(dest: Path) -> Path:
    """The tests' tiny hermes_think model (harness/families.py) with a 16k context."""
    from harness.families import make_family_tokenizer
    from harness.models import CACHE, SMOL, make_tiny_model
    from lmspd.models.pull import pull_builtin

    smol = pull_builtin(SMOL, CACHE / "models")  # instant once the test suite has pulled it
    tokenizer = make_family_tokenizer(dest.with_name(dest.name + "-tok"), smol, "hermes_think")
    return make_tiny_model(dest, tokenizer, seed=0, context=16384)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--restart-before", type=int, default=5, help="kill -9 and restart before this turn (0: never)")
    parser.add_argument("--tokens", type=int, default=24, help="the server's default_max_output_tokens")
    parser.add_argument("--thinker", action="store_true", help="the tests' tiny reasoning model")
    parser.add_argument("--strip", action="store_true", help="leave out the fields of Codex's request surface")
    args = parser.parse_args()
    base = load_config()
    model = "thinker" if args.thinker else args.model or base.default_model
    payload = body("multi-agent-off-turn2")
    payload["input"] = without_reasoning_tokens(payload["input"])
    with tempfile.TemporaryDirectory(prefix="lmspd-bench-agent-") as tmp:
        work = Path(tmp)
        config = (
            f'cache_dir = "{base.model_cache_dir}"\n'
            f'[server]\ndata_dir = "{work}"\ndefault_max_output_tokens = {args.tokens}\n'
        )
        if args.thinker:
            config += f'[models.thinker]\npath = "{thinker_model(work / "thinker")}"\n'

        proc: subprocess.Popen[bytes]
        proc, url = serve(work, config)
        rows: list[Turn] = []
        history = payload["input"]
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
                row = turn(url, model, dict(payload, input=history), args.strip)
                rows.append(row)
                ratio = row.ttft / rows[0].ttft
                print(
                    f"turn {n}: {row.prompt} prompt tokens, {row.cached} cached, time to first token "
                    f"{row.ttft:.2f} s, {ratio:.3f} of turn 1; {row.output} output tokens "
                    f"({', '.join(i['type'] for i in row.items)}); {row.reasoning_sent} reasoning tokens replayed",
                    flush=True,
                )
                history = next_input(history, row.items, n)
        finally:
            kill(proc, signal.SIGKILL)
        print()
        worst = max((r.ttft / rows[0].ttft for r in rows[1:]), default=0.0)
        print(f"worst turn 2..{len(rows)} time to first token / turn 1: {worst:.3f} (goal <= 0.1)")


if __name__ == "__main__":
    main()
