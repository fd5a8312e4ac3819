"""Coding agents on the bundled model, tried as a new user would: how often does a turn complete?
(issue 42, item 7; docs/benchmarks.md, "Agents on the bundled model")

    python -m bench.agents [--agent codex|claude|both] [--runs 10] [--timeout 300]
                           [--sampling-defaults model|openai] [--model M]

Starts ``lmspd serve`` with nothing configured but its model cache, a fresh data directory and
``sampling_defaults`` (``model``, the server's default: each model samples with its own
defaults where a request names none, the bundled model's temperature 0.2 and top_p 0.9;
``openai``: temperature 1 and top_p 1, as lmspd did before models had defaults of their own),
so the default model, the bundled SmolLM2-135M-Instruct, and every other default of the server.
Then runs each agent ``--runs`` times, each run with at most ``--timeout`` seconds (a run past
it is killed with its process group and counts as failed):

- the Codex CLI (the pinned 0.171.0: ``LMSPD_CODEX``, else the test cache's, else ``codex`` on
  PATH) as ``codex exec --json "say hello"``, configured as the README's "Coding agents"
  section says for an 8k-context model (``harness/codex.py``), a fresh CODEX_HOME each
  run in the same workspace folder (a person trying it again in their project); a run
  completed when Codex exits 0 with a final agent message;
- Claude Code (the pinned 2.1.332: ``LMSPD_CLAUDE``, else the test cache's
  ``claude/2.1.332/node_modules/.bin/claude``, else ``claude`` on PATH) as ``claude -p
  "Reply with: hello" --tools Bash,Read,Edit --model M --output-format json`` with
  ``ANTHROPIC_BASE_URL`` the server, ``ANTHROPIC_API_KEY=sk-local``, a fresh HOME and
  CLAUDE_CONFIG_DIR each run and its telemetry, updater and other traffic off
  (docs/messages.md, "What Claude Code sends"); a run completed when it exits 0 with a result
  that is not an error.

Before each run the server is left to settle, so no run shares the engine with the one before.
Prints per run: the exit status, the answer's first words or why the turn failed (the agent's
error), the turn's tokens as the agent counts them (input, cached, output), the server's own
count of responses, output tokens and of generations cut by their budget or the context
(``finish_reason`` length), and the wall time; then per agent the completion rate, the median
wall time and the failures' reasons.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.claude import CLAUDE_VERSION, claude_binary
from harness.codex import codex_binary, codex_config
from harness.server import kill, serve
from lmspd.config import load_config
from lmspd.store.status import ACTIVE

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = {"codex": "say hello", "claude": "Reply with: hello"}


@dataclass
class Run:
    rc: int | None  # None: killed at the timeout
    message: str | None  # the agent's final answer (None: the turn failed)
    error: str | None  # why the agent failed the turn
    tokens: tuple[Any, Any, Any] | None  # the agent's count: input, cached input, output
    server_output_tokens: int
    responses: int  # tasks the server created for the run
    cut: int  # generations ended by length: their budget or the context
    secs: float

    @property
    def completed(self) -> bool:
        return self.rc == 0 and self.message is not None


def metrics(url: str) -> dict[str, float]:
    """The server's counters this benchmark reads, by name and label."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def settled(url: str, timeout: float = 600) -> dict[str, float]:
    """The counters once no task is queued or running (a killed run's generation cancelled)."""
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(url)
        if not any(now.get(f"lmspd_tasks{{status={s}}}") for s in ACTIVE) or time.monotonic() > deadline:
            return now
        time.sleep(1)


def delta(before: dict[str, float], after: dict[str, float], key: str) -> int:
    return int(after.get(key, 0.0) - before.get(key, 0.0))


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_agent(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str, str, float]:
    """``cmd`` in its own process group (``codex`` and ``claude`` are node wrappers: a kill
    must reach the whole group, or a surviving child keeps its request, and the server
    generating, alive). Returns (rc, None when killed at the timeout; stdout; stderr; seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rc: int | None
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        rc = None
    finally:
        if proc.poll() is None:  # the benchmark itself was stopped
            kill_group(proc.pid)
    return rc, out, err, time.monotonic() - start


def fresh(place: Path, *names: str) -> list[Path]:
    folders = [place / name for name in names]
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    return folders


def workspace(place: Path) -> Path:
    """The same small project for every run of every agent."""
    (work,) = fresh(place, "work")
    (work / "src").mkdir()
    (work / "README.md").write_text("# demo\n")
    (work / "src" / "main.py").write_text('print("hi")\n')
    return work


def counted(url: str, before: dict[str, float], rc: int | None, secs: float, **fields: Any) -> Run:
    after = settled(url)
    return Run(
        rc=rc,
        secs=secs,
        server_output_tokens=delta(before, after, "lmspd_output_tokens_total{}"),
        responses=sum(delta(before, after, k) for k in after if k.startswith("lmspd_tasks_created_total{")),
        cut=delta(before, after, "lmspd_generations_finished_total{reason=length}"),
        **fields,
    )


def codex_run(codex: Path, url: str, model: str, place: Path, prompt: str, timeout: float) -> Run:
    """One ``codex exec`` in ``place``'s fresh CODEX_HOME and workspace."""
    home, user = fresh(place, "codex-home", "home")
    work = workspace(place)
    (home / "config.toml").write_text(codex_config(url, model, agents=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), HOME=str(user), RUST_LOG="warn")
    before = settled(url)
    cmd = [str(codex), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--json", prompt]
    rc, out, err, secs = run_agent(cmd, work, env, timeout)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    messages = [
        str(e["item"]["text"]) for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
    ]
    errors = [json.dumps(e.get("message") or e.get("error")) for e in events if e["type"] in ("error", "turn.failed")]
    error = errors[-1] if errors else None
    if error is None and rc != 0:
        error = "killed at the timeout" if rc is None else (err.strip().splitlines() or ["?"])[-1]
    usage = next((e["usage"] for e in events if e["type"] == "turn.completed"), None)
    tokens = (
        (usage.get("input_tokens"), usage.get("cached_input_tokens"), usage.get("output_tokens")) if usage else None
    )
    message = messages[-1] if messages else None
    return counted(url, before, rc, secs, message=message, error=error, tokens=tokens)


def claude_run(claude: Path, url: str, model: str, place: Path, prompt: str, timeout: float) -> Run:
    """One ``claude -p`` with a fresh HOME and CLAUDE_CONFIG_DIR in the workspace."""
    user, config = fresh(place, "home", "claude-config")
    work = workspace(place)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(
        HOME=str(user),
        CLAUDE_CONFIG_DIR=str(config),
        ANTHROPIC_BASE_URL=url,
        ANTHROPIC_API_KEY="sk-local",
        DISABLE_TELEMETRY="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
    )
    before = settled(url)
    cmd = [str(claude), "-p", prompt, "--tools", "Bash,Read,Edit", "--model", model, "--output-format", "json"]
    rc, out, err, secs = run_agent(cmd, work, env, timeout)
    result: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                result = json.loads(line)
    text = result.get("result")
    message = text if isinstance(text, str) and text and not result.get("is_error") else None
    error: str | None = None
    if rc is None:
        error = "killed at the timeout"
    elif message is None or rc != 0:
        said = text if isinstance(text, str) and text else result.get("subtype")
        error = str(said or (err.strip().splitlines() or out.strip().splitlines() or ["?"])[-1])
    usage = result.get("usage")
    tokens = (
        (usage.get("input_tokens"), usage.get("cache_read_input_tokens"), usage.get("output_tokens"))
        if isinstance(usage, dict)
        else None
    )
    return counted(url, before, rc, secs, message=message, error=error, tokens=tokens)


def shown(run: Run) -> str:
    status = "timeout" if run.rc is None else f"rc {run.rc}"
    said = f"said {run.message[:40]!r}" if run.message is not None else f"failed: {(run.error or '?')[:120]}"
    tokens = "agent tokens in/cached/out " + ("/".join(str(t) for t in run.tokens) if run.tokens else "-")
    return (
        f"{status}, {said}; {tokens}; server: {run.responses} responses, {run.server_output_tokens} output tokens, "
        f"{run.cut} cut by length; {run.secs:.0f} s"
    )


def reason(run: Run) -> str:
    said = "killed at the timeout" if run.rc is None else (run.error or "?")[:70]
    return said + (f" ({run.cut} generations cut by length)" if run.cut else "")


def summary(agent: str, prompt: str, runs: list[Run]) -> str:
    done = [r for r in runs if r.completed]
    # A crude look at what came back: does the answer to "say hello" contain "hello"?
    hello = sum("hello" in (r.message or "").lower() for r in done)
    median = statistics.median(r.secs for r in runs) if runs else 0.0
    why = Counter(reason(r) for r in runs if not r.completed)
    return (
        f"{agent} {prompt!r}: {len(done)} of {len(runs)} completed ({hello} with 'hello'), median {median:.0f} s"
        + "".join(f"\n  failed {n}x: {reason}" for reason, n in why.most_common())
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agent", choices=["codex", "claude", "both"], default="both")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run; a run past it failed")
    parser.add_argument(
        "--sampling-defaults",
        choices=["model", "openai"],
        default="model",
        help="the server's sampling_defaults: each model's own, or temperature 1 / top_p 1 for all",
    )
    parser.add_argument("--model", default=None, help="the model the agents name (default: the server's default)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed benchmark stops its server too
    agents: list[tuple[str, Path, Callable[..., Run]]] = []
    if args.agent in ("codex", "both"):
        if (codex := codex_binary()) is None:
            sys.exit("no Codex CLI: npm i --prefix .test-cache/codex/0.171.0 @openai/codex@0.171.0 (or LMSPD_CODEX)")
        agents.append(("codex", codex, codex_run))
    if args.agent in ("claude", "both"):
        if (claude := claude_binary()) is None:
            sys.exit(
                f"no Claude Code: npm i --prefix .test-cache/claude/{CLAUDE_VERSION} "
                f"@anthropic-ai/claude-code@{CLAUDE_VERSION} (or LMSPD_CLAUDE)"
            )
        agents.append(("claude", claude, claude_run))
    base = load_config()
    model = args.model or base.default_model
    results: dict[str, list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="lmspd-bench-agents-") as tmp:
        work = Path(tmp)
        config = (
            f'cache_dir = "{base.model_cache_dir}"\nsampling_defaults = "{args.sampling_defaults}"\n'
            f'[server]\ndata_dir = "{work / "data"}"\n'
        )
        proc, url = serve(work, config, timeout=600)
        try:
            listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
            defaults = listed[model].get("sampling_defaults")
            print(f"sampling_defaults = {args.sampling_defaults!r}: {model} samples with {defaults}")
            for agent, binary, run in agents:
                version = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout.strip()
                print(f"{agent}: {version}", flush=True)
                results[agent] = []
                for n in range(1, args.runs + 1):
                    results[agent].append(run(binary, url, model, work / "agent", PROMPTS[agent], args.timeout))
                    print(f"{agent} run {n}: {shown(results[agent][-1])}", flush=True)
        finally:
            kill(proc, signal.SIGTERM)
    print()
    for agent, runs in results.items():
        print(f"sampling_defaults {args.sampling_defaults}: {summary(agent, PROMPTS[agent], runs)}")


if __name__ == "__main__":
    main()
