"""``bench.agent_session`` end to end on a tiny model (its figures are the bundled model's,
docs/benchmarks.md, "Agent sessions"): Codex's session on /v1/responses and Claude Code's on
/v1/messages, each three turns with a ``kill -9`` and restart before the third. Every turn after
the first reads at least the whole previous prompt from the prompt cache (Messages:
``cache_read_input_tokens``), although Claude Code's billing header leads its system prompt and
its ``cache_control`` mark moves. No duration is asserted: the ratios are the benchmark's to
print. The benchmark runs as its command line, as a user runs it."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys

import pytest

from harness.models import ROOT
from lmspd.models.registry import ResolvedModel

TURN = re.compile(r"^turn (\d+): (\d+) prompt tokens, (\d+) cached,", re.M)


@pytest.mark.slow
@pytest.mark.parametrize("client", ["codex", "claude-code"])
def test_every_turn_after_the_first_is_read_from_the_cache(brief_8k: ResolvedModel, client: str) -> None:
    flags = ["--messages", "--max-tokens", "16"] if client == "claude-code" else []
    command = [*flags, "--model-path", str(brief_8k.path), "--turns", "3", "--restart-before", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.agent_session", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    assert "-- lmspd serve killed with SIGKILL and started again --" in out and "worst turn 2..3" in out, out
    rows = [(int(prompt), int(cached)) for _, prompt, cached in TURN.findall(out)]
    assert len(rows) == 3 and rows[0][1] == 0 and rows[0][0] > 3000, out
    for (before, _), (after, cached) in itertools.pairwise(rows):
        assert after > before and cached >= before, out
