"""The benchmarks' command lines answer --help (bench.raw used to die with an IndexError)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.models import ROOT


@pytest.mark.parametrize(
    "module",
    [
        "bench.raw",
        "bench.step_profile",
        "bench.matvec",
        "bench.memory",
        "bench.peers",
        "bench.agents",
        "bench.agent_session",
        "bench.quality",
    ],
)
def test_help_exits_cleanly(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")
