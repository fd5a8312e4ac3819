"""GGUF → mlx-lm conversion: names, config, and the converted model's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmspd.errors import ModelConversionError
from lmspd.models.gguf import convert_gguf, rename_tensor


@pytest.mark.parametrize(
    ("gguf", "mlx"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("token_embd.scales", "model.embed_tokens.scales"),
        ("output_norm.weight", "model.norm.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_k.biases", "model.layers.12.self_attn.k_proj.biases"),
        ("blk.3.attn_v.scales", "model.layers.3.self_attn.v_proj.scales"),
        ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight"),
        ("blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight"),
        ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
        ("blk.7.attn_norm.weight", "model.layers.7.input_layernorm.weight"),
        ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),
        ("output.weight", "lm_head.weight"),
    ],
)
def test_rename_tensor(gguf: str, mlx: str) -> None:
    assert rename_tensor(gguf) == mlx


@pytest.mark.parametrize("name", ["blk.0.attn_qkv.weight", "rope_freqs.weight", "blk.x.attn_q.weight"])
def test_rename_rejects_unknown_tensors(name: str) -> None:
    with pytest.raises(ModelConversionError, match="unsupported GGUF tensor"):
        rename_tensor(name)


def test_converted_config(smol_dir: Path) -> None:
    config = json.loads((smol_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "rope_traditional": True,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }


def test_converted_weights_have_mlx_names(smol_dir: Path) -> None:
    import mlx.core as mx

    weights = mx.load(str(smol_dir / "model.safetensors"))
    assert isinstance(weights, dict)
    assert len(weights) == 694
    layer = {k.split("layers.0.", 1)[1] for k in weights if k.startswith("model.layers.0.")}
    projections = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    expected = {f"{p}.{kind}" for p in projections for kind in ("weight", "scales", "biases")}
    expected |= {"input_layernorm.weight", "post_attention_layernorm.weight"}
    assert layer == expected
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].dtype == mx.uint32
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (1536, 576 * 4 // 32)


def test_truncated_gguf_is_a_clear_error(gguf_path: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf_path.read_bytes()[:5_000_000])
    out = tmp_path / "out"
    with pytest.raises(ModelConversionError, match="cannot read GGUF"):
        convert_gguf(broken, out)
    assert not out.exists()


def test_non_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelConversionError):
        convert_gguf(bogus, tmp_path / "out")
