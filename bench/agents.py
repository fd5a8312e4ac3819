"""Coding agents on the bundled model, tried as a new user would: how often does a turn complete?
(issue 42, item 7; docs/responses.md, "Agents on the bundled model")

    python -m bench.agents [--runs 10] [--timeout 300] [--prompt "say hello"] [--model M]

Starts ``lmspd serve`` with nothing configured but its model cache and a fresh data directory
(so the default model, the bundled SmolLM2-135M-Instruct, and every default of the server),
then runs the Codex CLI (the pinned 0.171.0: ``LMSPD_CODEX``, else the test cache's, else
``codex`` on PATH) ``--runs`` times as ``codex exec --json PROMPT``, configured as the README's
"Coding agents" section says for an 8k-context model (``tests/support/codex.py``). Each run
gets a fresh CODEX_HOME in the same workspace folder (a person trying it again in their
project), and at most ``--timeout`` seconds: a run past it is killed and counts as failed.
Before the next run the server is left to settle, so no run shares the engine with the one
before.

Prints per run: Codex's exit status, whether a final agent message came back (its first words),
why a failed turn failed (Codex's error), the turn's tokens as Codex counts them (input, cached,
output: none for a failed turn), the server's own count of output tokens and of responses cut
by their budget or the context (``finish_reason`` length), and the wall time; then the
completion rate. Claude Code (``claude -p``) joins here once lmspd serves the Messages API.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serving import kill, serve
from lmspd.config import load_config
from lmspd.store.status import ACTIVE

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.codex import codex_binary, codex_config  # noqa: E402  (tests/support)


@dataclass
class Run:
    rc: int | None  # None: killed at the timeout
    message: str | None  # the final agent message
    error: str | None  # why Codex failed the turn
    usage: dict[str, int] | None  # Codex's turn usage (a completed turn only)
    server_output_tokens: int
    responses: int
    cut: int  # responses ended by length: their budget or the context
    secs: float

    @property
    def completed(self) -> bool:
        return self.rc == 0 and bool(self.message)


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


def codex_run(codex: Path, url: str, model: str, place: Path, prompt: str, timeout: float) -> Run:
    """One ``codex exec`` in ``place``'s fresh CODEX_HOME and workspace."""
    home, user, work = place / "codex-home", place / "home", place / "work"
    for folder in (home, user, work):
        shutil.rmtree(folder, ignore_errors=True)
    for folder in (home, user, work / "src"):
        folder.mkdir(parents=True)
    (home / "config.toml").write_text(codex_config(url, model, agents=False))
    (work / "README.md").write_text("# demo\n")
    (work / "src" / "main.py").write_text('print("hi")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), HOME=str(user), RUST_LOG="warn")
    before = settled(url)
    cmd = [str(codex), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--json", prompt]
    start = time.monotonic()
    # Its own process group: `codex` is a node wrapper around the native binary, and a kill
    # must reach both (a surviving binary keeps its request, and the server generating, alive).
    proc = subprocess.Popen(
        cmd,
        cwd=work,
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
    secs = time.monotonic() - start
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    messages = [
        str(e["item"]["text"]) for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
    ]
    errors = [json.dumps(e.get("message") or e.get("error")) for e in events if e["type"] in ("error", "turn.failed")]
    error = errors[-1] if errors else None
    if error is None and rc != 0:
        error = "killed at the timeout" if rc is None else (err.strip().splitlines() or ["?"])[-1]
    usage = next((e["usage"] for e in events if e["type"] == "turn.completed"), None)
    after = settled(url)
    return Run(
        rc=rc,
        message=messages[-1] if messages else None,
        error=error,
        usage=usage,
        server_output_tokens=delta(before, after, "lmspd_output_tokens_total{}"),
        responses=delta(before, after, "lmspd_tasks_created_total{kind=response}"),
        cut=delta(before, after, "lmspd_generations_finished_total{reason=length}"),
        secs=secs,
    )


def shown(run: Run) -> str:
    status = "timeout" if run.rc is None else f"rc {run.rc}"
    said = f"said {run.message[:40]!r}" if run.message else f"failed: {(run.error or '?')[:90]}"
    tokens = (
        f"codex tokens in/cached/out {run.usage.get('input_tokens')}/{run.usage.get('cached_input_tokens')}/"
        f"{run.usage.get('output_tokens')}"
        if run.usage
        else "codex tokens -"
    )
    return (
        f"{status}, {said}; {tokens}; server: {run.responses} responses, {run.server_output_tokens} output tokens, "
        f"{run.cut} cut by length; {run.secs:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run; a run past it failed")
    parser.add_argument("--prompt", default="say hello")
    parser.add_argument("--model", default=None, help="the model Codex names (default: the server's default)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed benchmark stops its server too
    codex = codex_binary()
    if codex is None:
        sys.exit("no Codex CLI: npm i --prefix .test-cache/codex/0.171.0 @openai/codex@0.171.0 (or LMSPD_CODEX)")
    base = load_config()
    model = args.model or base.default_model
    version = subprocess.run([str(codex), "--version"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="lmspd-bench-agents-") as tmp:
        work = Path(tmp)
        config = f'cache_dir = "{base.model_cache_dir}"\n[server]\ndata_dir = "{work / "data"}"\n'
        proc, url = serve(work, config, timeout=600)
        runs: list[Run] = []
        try:
            listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
            print(f"{version} on {model}; the model's sampling defaults: {listed[model].get('sampling_defaults')}")
            for n in range(1, args.runs + 1):
                runs.append(codex_run(codex, url, model, work / "agent", args.prompt, args.timeout))
                print(f"run {n}: {shown(runs[-1])}", flush=True)
        finally:
            kill(proc, signal.SIGTERM)
    done = sum(r.completed for r in runs)
    # A crude look at what came back: does the answer to "say hello" contain "hello"?
    hello = sum(r.completed and "hello" in (r.message or "").lower() for r in runs)
    print(f"\ncodex exec {args.prompt!r}: {done} of {len(runs)} turns completed, {hello} answers with 'hello'")


if __name__ == "__main__":
    main()
