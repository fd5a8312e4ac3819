"""harness.big_model: the random-weight Llama written as a Q4_1 GGUF, at the tests' tiny shape
(the same code as the 1B model, a few MB, seconds)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.big_model import BIG, TINY, parameter_count, write_gguf
from lmspd.models.gguf import convert_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    return write_gguf(tmp_path_factory.mktemp("big") / "tiny.gguf", TINY, seed=0, tokenizer_from=gguf_path)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_big_shape_is_about_a_billion_parameters() -> None:
    assert 1.0e9 < parameter_count(BIG) < 1.2e9


def test_same_seed_same_bytes(tiny_gguf: Path, gguf_path: Path, tmp_path: Path) -> None:
    again = write_gguf(tmp_path / "again.gguf", TINY, seed=0, tokenizer_from=gguf_path)
    other = write_gguf(tmp_path / "other.gguf", TINY, seed=1, tokenizer_from=gguf_path)
    assert _digest(again) == _digest(tiny_gguf)
    assert _digest(other) != _digest(tiny_gguf)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.gguf", "other.gguf"]  # no temporary left


def test_a_llama_gguf_with_the_bundled_tokenizer(tiny_gguf: Path, gguf_path: Path) -> None:
    from gguf import GGUFReader

    ours, theirs = GGUFReader(tiny_gguf), GGUFReader(gguf_path)
    assert ours.fields["general.architecture"].contents() == "llama"
    assert ours.fields["llama.block_count"].contents() == TINY.layers
    assert ours.fields["llama.attention.head_count_kv"].contents() == TINY.kv_heads
    tokenizer_keys = sorted(k for k in theirs.fields if k.startswith("tokenizer."))
    assert sorted(k for k in ours.fields if k.startswith("tokenizer.")) == tokenizer_keys
    for key in tokenizer_keys:  # same values and same value types: llama.cpp reads both
        assert ours.fields[key].types == theirs.fields[key].types, key
        assert ours.fields[key].contents() == theirs.fields[key].contents(), key
    types = {t.name: t.tensor_type.name for t in ours.tensors}
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.1.ffn_down.weight"] == "Q4_1"
    assert types["output_norm.weight"] == "F32"
    assert sum(int(t.n_elements) for t in ours.tensors) == parameter_count(TINY)


def test_lmspd_converts_it_exactly(tiny_gguf: Path, tmp_path: Path) -> None:
    """lmspd's converter takes the file, and its MLX weights are the GGUF's to the bit: Q4_1 is
    affine (d * q + m), as MLX's 4-bit groups of 32 are."""
    import mlx.core as mx
    from gguf import GGUFReader, quants

    out = tmp_path / "converted"
    config = convert_gguf(tiny_gguf, out)
    assert json.loads((out / "config.json").read_text()) == config
    expected = {
        "hidden_size": TINY.hidden,
        "num_hidden_layers": TINY.layers,
        "intermediate_size": TINY.intermediate,
        "num_attention_heads": TINY.heads,
        "num_key_value_heads": TINY.kv_heads,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    weights: dict[str, Any] = mx.load(str(out / "model.safetensors"))  # type: ignore[assignment]
    source = {t.name: t for t in GGUFReader(tiny_gguf).tensors}
    for gguf_name, mlx_name, bits in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj", 4),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj", 4),
        ("token_embd.weight", "model.embed_tokens", 8),
    ]:
        tensor = source[gguf_name]
        want = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        # Scales and biases in float32, as the GGUF side dequantizes: in their own float16
        # MLX would round each product back to float16.
        got = mx.dequantize(
            weights[f"{mlx_name}.weight"],
            weights[f"{mlx_name}.scales"].astype(mx.float32),
            weights[f"{mlx_name}.biases"].astype(mx.float32),
            group_size=32,
            bits=bits,
        )
        np.testing.assert_array_equal(np.array(got), want)
        assert 0.01 < float(np.std(want)) < 0.03  # the generator's std 0.02, through quantization
