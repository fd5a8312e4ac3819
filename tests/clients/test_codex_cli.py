"""The real Codex CLI (``codex exec``) against a real ``lmspd serve``, configured as the
README's "Coding agents" section says: a provider block with ``wire_api = "responses"`` and
``web_search = "disabled"`` (and, for the bundled model's 8k context, ``[agents] enabled =
false``), or the provider block alone with the server's ``hosted_tools = "omit"``.

A tiny random model answers, with the bundled model's 8k context (Codex's request without
its multi-agent namespace is ~6,500 tokens with its tools) or a 16k one (~9,200 with it): a
``brief`` one, which ends its answers by itself after a few tokens, since Codex fails a turn
whose answer was cut by its budget ("Incomplete response returned"). Each of Codex's requests
costs a second, not minutes (``default_max_output_tokens`` bounds a stray one). Whatever the
model says, Codex must run its turn to the end: exit 0 and an agent message.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.clients import require
from harness.codex import CODEX_VERSION, codex_binary, codex_config
from harness.models import ROOT
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

SERVER = "default_max_output_tokens = 64\n"


@pytest.fixture(scope="session")
def codex() -> Path:
    """The Codex CLI (``@openai/codex``, the version .ci/run pins); skipped where it is
    missing, except under CI (harness.clients)."""
    return require(f"the Codex CLI (npm i @openai/codex@{CODEX_VERSION}, or LMSPD_CODEX)", codex_binary())


@pytest.fixture(scope="module")
def server_8k(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, brief_8k: ResolvedModel) -> Iterator[Server]:
    with tiny_server(tmp_path_factory.mktemp("codex-8k"), model_cache, brief_8k, server=SERVER) as srv:
        srv.start()
        yield srv


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, brief_16k: ResolvedModel) -> Iterator[Server]:
    with tiny_server(tmp_path_factory.mktemp("codex"), model_cache, brief_16k, server=SERVER) as srv:
        srv.start()
        yield srv


@pytest.fixture(scope="module")
def omit_server(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, brief_16k: ResolvedModel
) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("codex-omit")
    with tiny_server(tmp, model_cache, brief_16k, server=SERVER, responses='hosted_tools = "omit"\n') as srv:
        srv.start()
        yield srv


def codex_exec(codex: Path, tmp: Path, config: str, prompt: str) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    """``codex exec --json`` in a fresh workspace with ``config`` as its only configuration
    (its own CODEX_HOME, and an empty HOME so no shell profile runs): the process and the
    JSON events it printed."""
    home, user, work = tmp / "codex-home", tmp / "home", tmp / "work"
    for folder in (home, user, work / "src"):
        folder.mkdir(parents=True)
    (home / "config.toml").write_text(config)
    (work / "README.md").write_text("# demo\n")
    (work / "src" / "main.py").write_text('print("hi")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), HOME=str(user), RUST_LOG="warn")
    proc = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "--json", prompt],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, events


def agent_messages(events: list[Any]) -> list[str]:
    return [
        str(e["item"]["text"]) for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"
    ]


def check_turn(server: Server, proc: subprocess.CompletedProcess[str], events: list[Any]) -> None:
    failure = f"codex exited {proc.returncode}\n{proc.stderr[-4000:]}\n{proc.stdout[-4000:]}\n"
    assert proc.returncode == 0, failure + server.log.read_text()[-4000:]
    assert [e["type"] for e in events][-1] == "turn.completed", failure
    assert any(agent_messages(events)), failure
    assert "POST /v1/responses 200" in server.log.read_text()


def test_codex_exec_completes_a_turn_on_an_8k_model(codex: Path, server_8k: Server, tmp_path: Path) -> None:
    """The README's config for the bundled model (8k context)."""
    config = codex_config(server_8k.url, "tiny", agents=False)
    proc, events = codex_exec(codex, tmp_path, config, "List the files in this folder.")
    check_turn(server_8k, proc, events)


def test_codex_exec_completes_a_turn_with_its_namespace(codex: Path, server: Server, tmp_path: Path) -> None:
    """Only a provider block and ``web_search = "disabled"``: the multi-agent namespace offered."""
    config = codex_config(server.url, "tiny")
    proc, events = codex_exec(codex, tmp_path, config, "List the files in this folder.")
    check_turn(server, proc, events)


def test_codex_exec_with_web_search_on_and_the_server_omitting_it(
    codex: Path, omit_server: Server, tmp_path: Path
) -> None:
    config = codex_config(omit_server.url, "tiny", web_search=True)
    proc, events = codex_exec(codex, tmp_path, config, "List the files in this folder.")
    check_turn(omit_server, proc, events)
    assert "web_search" in omit_server.log.read_text()  # the log says what it left out


def test_ci_installs_the_codex_cli_the_suite_pins() -> None:
    assert f"CODEX_VERSION={CODEX_VERSION} " in (ROOT / ".ci" / "run").read_text()
