"""The test cache, the bundled model's catalog entry, and the tiny random-weight models.

The tiny models are real mlx-lm llama directories (random weights, 4-bit like the
bundled model) with the real SmolLM2 tokenizer, so the real engine path runs in
milliseconds per token. bench/ builds its models here too (one definition).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmspd.models.catalog import BUILTIN_MODELS

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LMSPD_TEST_CACHE", ROOT / ".test-cache"))
# The engine builds its kernels once per machine (about 10 s), not once per test server.
os.environ.setdefault("LMSPD_KERNEL_DIR", str(CACHE / "kernels"))
SMOL = BUILTIN_MODELS["smollm2-135m-instruct"]


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Held while filling ``CACHE/<name>``: the suite's workers (pytest-xdist) take turns, and
    the one that waited finds the entry made."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# A random Llama whose layers outweigh its embeddings (the bundled tokenizer's 49,152 rows):
# 24 layers of width 1024, about 450M parameters, 4-bit. Split over two hosts, each holds its
# 12 layers and the embeddings (docs/distributed.md).
LAYERED = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 64,
}


def make_tiny_model(
    out: Path,
    tokenizer_from: Path,
    seed: int = 0,
    context: int = 256,
    *,
    brief: bool = False,
    shape: dict[str, int] | None = None,
) -> Path:
    """A 2-layer llama with random 4-bit weights and the real tokenizer.

    ``shape``: config keys overriding the tiny shape (``LAYERED``: a model of 450M parameters).

    ``brief``: a model that ends its answers by itself (random weights almost never say
    end-of-sequence), for clients that take an answer cut by its token budget for a failure
    (Codex CLI: "Incomplete response returned"). Float32 weights, not 4-bit (exact zeros are
    the mechanism), and its own output head: after any token whose id is a multiple of 3
    (newlines excepted, so the first token after the prompt is a word), end-of-sequence
    wins. The residual stream's last dimension carries that mark unchanged: the embeddings
    hold it (1 for those tokens, 0 for the rest), no layer writes it, and only
    end-of-sequence's row of the head reads it. An answer is then a few random tokens."""
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
        "tie_word_embeddings": not brief,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "quantization": {"group_size": 32, "bits": 4},
        **(shape or {}),
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
    if brief:
        _end_answers(model, Tokenizer.from_file(str(tokenizer_from / "tokenizer.json")), config)
        del config["quantization"]
    else:
        nn.quantize(model, group_size=32, bits=4)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def _end_answers(model: Any, tokenizer: Any, config: dict[str, Any]) -> None:
    """``make_tiny_model(brief=True)``'s head and mark (its docstring)."""
    import mlx.core as mx

    mark, eos, vocab = config["hidden_size"] - 1, config["eos_token_id"], config["vocab_size"]
    embed = model.model.embed_tokens.weight
    model.lm_head.weight = embed  # the random head the tied model had, then made to ignore the mark
    ids = mx.arange(vocab)
    marked = (ids % 3 == 0).astype(embed.dtype)
    for text in ("\n", "\n\n", " \n"):
        for i in tokenizer.encode(text, add_special_tokens=False).ids:
            marked[i] = 0.0
    columns = mx.arange(config["hidden_size"]) == mark
    model.model.embed_tokens.weight = mx.where(columns[None, :], marked[:, None], embed)
    for layer in model.model.layers:  # no layer writes the mark's dimension
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.weight = mx.where(columns[:, None], 0.0, proj.weight)
    head = mx.where(columns[None, :], 0.0, model.lm_head.weight)
    rows = (ids == eos)[:, None]
    model.lm_head.weight = mx.where(rows, mx.where(columns[None, :], 1e4, 0.0), head)
