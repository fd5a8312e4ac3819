"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

MLX reads GGUF natively (``mx.load(..., return_metadata=True)``) and hands back
quantized weights already in MLX's affine layout (weight/scales/biases), so the
conversion is a rename plus a config and a tokenizer rebuilt from the metadata.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from lmspd.errors import ModelConversionError

_LAYER_RENAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_RENAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|scales|biases)$")

# token_type values defined by GGUF: 1 normal, 2 unknown, 3 control, 4 user defined.
_SPECIAL_TOKEN_TYPES = (2, 3, 4)


def rename_tensor(name: str) -> str:
    """Map one GGUF tensor name to its mlx-lm (Hugging Face) name."""
    if m := _BLOCK.match(name):
        layer, part, kind = m.groups()
        if part not in _LAYER_RENAMES:
            raise ModelConversionError(f"unsupported GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_LAYER_RENAMES[part]}.{kind}"
    if (m := _TOP.match(name)) and m.group(1) in _TOP_RENAMES:
        return f"{_TOP_RENAMES[m.group(1)]}.{m.group(2)}"
    raise ModelConversionError(f"unsupported GGUF tensor {name!r}")


def _scalar(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ModelConversionError(f"GGUF metadata lacks {key!r}")
    value = metadata[key]
    return value.item() if hasattr(value, "item") else value


def _bits_of(weights: dict[str, Any], name: str, group_size: int) -> int:
    """Bits per weight of a quantized tensor, from its packed and scale shapes."""
    packed_cols = weights[f"{name}.weight"].shape[-1]
    groups = weights[f"{name}.scales"].shape[-1]
    return int(packed_cols * 32 // (groups * group_size))


def build_config(metadata: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    """The mlx-lm ``config.json`` for a llama GGUF; ``weights`` already renamed."""
    arch = _scalar(metadata, "general.architecture")
    if arch != "llama":
        raise ModelConversionError(f"unsupported GGUF architecture {arch!r} (only 'llama')")
    hidden = int(_scalar(metadata, "llama.embedding_length"))
    heads = int(_scalar(metadata, "llama.attention.head_count"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(metadata, "llama.feed_forward_length")),
        "num_hidden_layers": int(_scalar(metadata, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(metadata, "llama.attention.head_count_kv")),
        "head_dim": int(metadata.get("llama.rope.dimension_count", hidden // heads)),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(_scalar(metadata, "llama.context_length")),
        # GGUF stores float32; round so 1e-5 stays 1e-5 rather than 9.99999974e-06.
        "rms_norm_eps": float(f"{_scalar(metadata, 'llama.attention.layer_norm_rms_epsilon'):.7g}"),
        "rope_theta": float(metadata.get("llama.rope.freq_base", 10000.0)),
        # llama.cpp permutes Q/K rows for interleaved ("traditional") RoPE.
        "rope_traditional": True,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": int(_scalar(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(metadata, "tokenizer.ggml.eos_token_id")),
    }
    config["quantization"] = _quantization(weights)
    return config


def _quantization(weights: dict[str, Any]) -> dict[str, Any]:
    """Quantization block: the common bits, plus per-module overrides."""
    group_size = 32
    modules = sorted({k[: -len(".scales")] for k in weights if k.endswith(".scales")})
    if not modules:
        raise ModelConversionError("GGUF holds no quantized tensors MLX can read")
    bits = {m: _bits_of(weights, m, group_size) for m in modules}
    common = max(set(bits.values()), key=list(bits.values()).count)
    quant: dict[str, Any] = {"group_size": group_size, "bits": common}
    for module, b in bits.items():
        if b != common:
            quant[module] = {"group_size": group_size, "bits": b}
    return quant


def build_tokenizer_json(metadata: dict[str, Any]) -> str:
    """A byte-level BPE ``tokenizer.json`` rebuilt from the GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ModelConversionError("only GPT-2 style (byte-level BPE) GGUF tokenizers are supported")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    types = metadata["tokenizer.ggml.token_type"].tolist()
    special = [
        AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in _SPECIAL_TOKEN_TYPES
    ]
    tokenizer.add_special_tokens(special)
    return str(tokenizer.to_str())


def build_tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        return tokens[int(_scalar(metadata, key))] if key in metadata else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": metadata.get("tokenizer.chat_template"),
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(_scalar(metadata, "llama.context_length")),
        "clean_up_tokenization_spaces": False,
    }


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json."""
    import mlx.core as mx

    try:
        loaded: Any = mx.load(str(gguf_path), return_metadata=True)
        raw: dict[str, Any] = loaded[0]
        metadata: dict[str, Any] = loaded[1]
    except Exception as exc:  # MLX raises bare RuntimeError/ValueError on bad files
        raise ModelConversionError(f"cannot read GGUF {gguf_path.name}: {exc}") from exc
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelConversionError("GGUF metadata lacks the tokenizer vocabulary")
    weights = {rename_tensor(k): v for k, v in raw.items()}
    config = build_config(metadata, weights)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "tokenizer.json").write_text(build_tokenizer_json(metadata))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(build_tokenizer_config(metadata), indent=2))
    return config
