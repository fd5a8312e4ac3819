"""The bundled SmolLM2-135M-Instruct, converted from its GGUF, answers sensibly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
FRANCE = "What is the capital of France?"


def _lmspd(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LMSPD_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "lmspd.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module", params=["float32", "quantized_float32"])
def paris(model_cache: Path, request: pytest.FixtureRequest) -> subprocess.CompletedProcess[str]:
    """The bundled model asked FRANCE once, greedily, by ``lmspd generate`` (the default
    model, the engine process) in each of auto's exact weight dtypes. Running it takes many
    seconds of CPU, so the tests below read this one run per dtype: what the engine answered
    and what the CLI printed of it. float32 holds every weight mx.dequantize gives exactly,
    and quantized_float32 keeps them packed and computes each as its exact affine value in
    float32 (lmspd's kernels): on the BLAS the engine runs on (OpenBLAS where installed, which orders the sums
    its own way) greedy decoding must give the quantized model's answer, "The capital of
    France is Paris." (docs/benchmarks.md), and end it the same way."""
    return _lmspd(
        "generate",
        FRANCE,
        "--temperature",
        "0",
        "--max-output-tokens",
        "24",
        "--weight-dtype",
        request.param,
        cache=model_cache,
    )


def test_france_is_paris_through_the_engine(paris: subprocess.CompletedProcess[str]) -> None:
    assert paris.returncode == 0, paris.stderr
    # The CLI writes the engine's deltas as they come and its Finished text, then a newline.
    assert paris.stdout == "The capital of France is Paris.\n"
    # Ended by <|im_end|>, not by the token limit.
    assert re.search(r"^\[stop: \d+ prompt \+ \d+ output tokens", paris.stderr, re.MULTILINE), paris.stderr


def test_cli_generate_prints_paris(paris: subprocess.CompletedProcess[str]) -> None:
    assert paris.returncode == 0, paris.stderr
    assert "Paris" in paris.stdout
    assert "tok/s" in paris.stderr


def test_cli_models_list_shows_the_pulled_default(model_cache: Path) -> None:
    done = _lmspd("models", "list", cache=model_cache)
    assert done.returncode == 0, done.stderr
    assert "smollm2-135m-instruct (default)\tbuiltin\tready" in done.stdout


def test_cli_unknown_model_is_an_error(model_cache: Path) -> None:
    done = _lmspd("generate", "hi", "--model", "no-such-model", cache=model_cache)
    assert done.returncode == 2
    assert "model_not_found" in done.stderr and "smollm2-135m-instruct" in done.stderr


def test_cli_prompt_over_the_context_fails_before_generating(tmp_path: Path, model_cache: Path) -> None:
    done = _lmspd("generate", "word " * 9000, cache=model_cache)
    assert done.returncode == 2
    assert "context_length_exceeded" in done.stderr


def test_cli_invalid_sampling_names_the_parameter(model_cache: Path) -> None:
    done = _lmspd("generate", "hi", "--temperature", "3", cache=model_cache)
    assert done.returncode == 2
    assert "[temperature]" in done.stderr


def test_cli_models_pull_is_idempotent(model_cache: Path) -> None:
    done = _lmspd("models", "pull", cache=model_cache)
    assert done.returncode == 0, done.stderr
    assert "smollm2-135m-instruct" in done.stdout
