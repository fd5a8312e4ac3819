"""The bundled SmolLM2-135M-Instruct, converted from its GGUF, answers sensibly."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from service.config import EngineConfig
from service.engine import protocol as p
from service.engine.client import EngineClient
from service.generation import build_generate
from service.models.registry import ResolvedModel

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
FRANCE = "What is the capital of France?"


async def test_france_is_paris_through_the_engine(smol: ResolvedModel) -> None:
    engine = EngineClient(EngineConfig(weight_dtype="auto"))
    await engine.start()
    try:
        cmd = build_generate(
            smol,
            [{"role": "user", "content": FRANCE}],
            request_id=uuid.uuid4().hex,
            max_tokens=20,
            sampling=p.SamplingParams(temperature=0.0),
        )
        text = ""
        async for ev in engine.generate(cmd):
            text += ev.text
            if isinstance(ev, p.Finished):
                assert ev.reason == "stop"  # ended by <|im_end|>, not by the token limit
        assert text == "The capital of France is Paris."
        assert engine.loaded[smol.name].weight_dtype in ("quantized", "float32")
    finally:
        await engine.close()


def _lmspd(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LMSPD_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_generate_prints_paris(model_cache: Path) -> None:
    done = _lmspd("generate", FRANCE, "--temperature", "0", "--max-output-tokens", "24", cache=model_cache)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "tok/s" in done.stderr


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
