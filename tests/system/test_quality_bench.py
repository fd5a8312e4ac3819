"""``bench.quality`` end to end on the bundled model (its figures: docs/benchmarks.md,
"Accuracy"), as a user runs it: the exact path agrees with itself, the dequantized float32
path (the same products summed in another order) is measured apart from it, by a little, and
both tables count what they say they count. No duration is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.models import ROOT
from lmspd.models.registry import ResolvedModel


def quality(smol: ResolvedModel, out: Path, *flags: str) -> dict[str, dict[str, dict[str, Any]]]:
    command = ["--model-dir", str(smol.path), "--paths", "quantized_float32,float32", "--json", str(out), *flags]
    done = subprocess.run(
        [sys.executable, "-m", "bench.quality", *command], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| path | mean tokens before the first difference | identical answers |" in done.stdout
    figures: dict[str, dict[str, dict[str, Any]]] = json.loads(out.read_text())
    return figures


@pytest.mark.slow
@pytest.mark.real_model
def test_both_tables_on_the_bundled_model(smol: ResolvedModel, tmp_path: Path) -> None:
    flags = ["--prompts", "3", "--tokens", "16", "--text-tokens", "256", "--window", "128"]
    figures = quality(smol, tmp_path / "q.json", *flags)
    agreement, divergence = figures["agreement"], figures["divergence"]
    assert set(agreement) == {"float32"}
    dense = agreement["float32"]
    assert len(dense["prefixes"]) == 3 and all(0 <= n <= 16 for n in dense["prefixes"])
    exact, other = divergence["quantized_float32"], divergence["float32"]
    assert exact["positions"] == other["positions"] == 256
    assert exact["kl_sum"] == 0 and exact["top1"] == 1  # against itself
    # Another summation order: other bits, measured, and close (top-1 all but never above 1).
    assert 0 < other["kl_mean"] < 1e-3 and 0.9 <= other["top1"] <= 1
    assert abs(other["perplexity"] / exact["perplexity"] - 1) < 0.01


@pytest.mark.slow
@pytest.mark.real_model
def test_one_token_a_step_scores_every_position(smol: ResolvedModel, tmp_path: Path) -> None:
    figures = quality(
        smol, tmp_path / "q.json", "--prompts", "1", "--tokens", "4", "--text-tokens", "24", "--window", "1"
    )
    assert figures["divergence"]["float32"]["positions"] == 24
