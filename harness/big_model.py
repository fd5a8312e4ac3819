"""A random-weight Llama of about 1B parameters, written as a Q4_1 GGUF: the memory-bound model.

The bundled SmolLM2 (135M) fits in a CPU's caches more than a real model does; every real user
runs a model whose weights stream from memory at each token. This one has a real 1B model's
shape (TinyLlama-1.1B's: hidden 2048, 22 layers, MLP 5632, 32 query heads over 4 KV heads) and
SmolLM2's vocabulary, tokenizer and chat template (its GGUF metadata copied over), so lmspd
(through its own GGUF converter) and llama-server (reading the file itself) tokenize and
template alike. The weights are random (normal, std 0.02, a fixed seed per tensor), laid out as
llama.cpp's Q4_1 quantization of SmolLM2 lays out its file: Q4_1 for every projection, Q8_0
for the tied embedding (also the output head), float32 norms. About 1.07B parameters, a 0.71 GB
file; its answers are gibberish, its speed a 1B model's.

    python -m harness.big_model                 # build (once) into the test cache, print the paths
    python -m harness.big_model OUT.gguf        # write the GGUF file there
    python -m harness.big_model --tiny OUT.gguf # the same code at a few MB (the tests' size)

Writing the file and converting it to lmspd's MLX directory took 46 s together on two busy
cores (mostly random numbers and numpy quantization); both stay in the test cache.
``python -m bench.peers --big`` serves it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.models import CACHE, SMOL, cache_lock

# The bundled model's GGUF, where the test cache keeps it (tests/conftest.py's gguf_path, and
# bench.peers' bundled_gguf): the source of the tokenizer metadata.
SMOL_GGUF = CACHE / "gguf" / Path(SMOL.member).name
STD = 0.02  # small enough that the residual stream stays finite through 22 random layers
ROWS_PER_CHUNK = 1024  # rows generated and quantized at a time: a tensor never sits whole in float32


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    context: int = 8192

    @property
    def name(self) -> str:
        """The cache entry's name: the shape is in it, so a changed shape is a new entry."""
        return f"llama-random-h{self.hidden}-l{self.layers}-i{self.intermediate}-a{self.heads}-kv{self.kv_heads}"


BIG = LlamaShape(hidden=2048, layers=22, intermediate=5632, heads=32, kv_heads=4)
TINY = LlamaShape(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, context=256)


def _tensors(shape: LlamaShape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape (rows = outputs), kind) of every tensor, in file order."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, shape.hidden), "Q8_0")]
    for i in range(shape.layers):
        out += [
            (f"blk.{i}.attn_norm.weight", (shape.hidden,), "norm"),
            (f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden), "Q4_1"),
            (f"blk.{i}.attn_k.weight", (kv, shape.hidden), "Q4_1"),
            (f"blk.{i}.attn_v.weight", (kv, shape.hidden), "Q4_1"),
            (f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden), "Q4_1"),
            (f"blk.{i}.ffn_norm.weight", (shape.hidden,), "norm"),
            (f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden), "Q4_1"),
            (f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden), "Q4_1"),
            (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate), "Q4_1"),
        ]
    return [*out, ("output_norm.weight", (shape.hidden,), "norm")]


def parameter_count(shape: LlamaShape, vocab: int = 49152) -> int:
    return sum(int(np.prod(dims)) for _, dims, _ in _tensors(shape, vocab))


def _data(index: int, dims: tuple[int, ...], kind: str, seed: int) -> np.ndarray[Any, Any]:
    """One tensor's bytes as the file holds them. Each tensor has a generator of its own
    (seeded by the model's seed and the tensor's index), so a tensor's values never depend on
    how the others were drawn."""
    from gguf import GGMLQuantizationType, quants

    if kind == "norm":
        return np.ones(dims, dtype=np.float32)  # RMSNorm weights of one: activations stay near unit scale
    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng([seed, index])
    rows, cols = dims
    chunks = []
    for start in range(0, rows, ROWS_PER_CHUNK):
        n = min(ROWS_PER_CHUNK, rows - start)
        chunks.append(quants.quantize(rng.standard_normal((n, cols), dtype=np.float32) * np.float32(STD), qtype))
    return np.concatenate(chunks)


def write_gguf(out: Path, shape: LlamaShape = BIG, seed: int = 0, tokenizer_from: Path = SMOL_GGUF) -> Path:
    """Write the model to ``out`` (whole or not at all: a temporary file renamed into place),
    streaming one tensor at a time so memory stays at one tensor's size."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    source = GGUFReader(tokenizer_from)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    tensors = _tensors(shape, vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = GGUFWriter(tmp, "llama")
        writer.add_name(f"random llama {shape.name} seed {seed}")
        writer.add_file_type(3)  # LLAMA_FTYPE_MOSTLY_Q4_1, as the bundled file says
        writer.add_quantization_version(2)
        writer.add_block_count(shape.layers)
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_dimension_count(shape.hidden // shape.heads)
        writer.add_rope_freq_base(10000.0)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_vocab_size(vocab)
        # The tokenizer as SmolLM2's file has it, key by key with its own value types (llama.cpp
        # is strict about them): vocabulary, merges, token types, special ids, chat template.
        for key, field in source.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        for name, dims, kind in tensors:
            if kind == "norm":
                writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
            else:
                qtype = GGMLQuantizationType[kind]
                block, size = _block(qtype)
                nbytes = dims[0] * dims[1] // block * size
                writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for index, (_, dims, kind) in enumerate(tensors):
            writer.write_tensor_data(_data(index, dims, kind, seed))
        writer.close()
        tmp.chmod(0o644)  # mkstemp's 0600 would keep it from other users' servers
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _block(qtype: Any) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGML quantization type."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    return int(block), int(size)


def cached_gguf(shape: LlamaShape = BIG, seed: int = 0, tokenizer_from: Path = SMOL_GGUF) -> Path:
    """The model's GGUF in the test cache, written on first use (concurrent callers take turns)."""
    out = CACHE / "big" / f"{shape.name}-s{seed}.Q4_1.gguf"
    with cache_lock("big"):
        if not out.exists():
            write_gguf(out, shape, seed, tokenizer_from)
    return out


def cached_model_dir(shape: LlamaShape = BIG, seed: int = 0, tokenizer_from: Path = SMOL_GGUF) -> Path:
    """lmspd's conversion of ``cached_gguf`` (lmspd.models.gguf, as ``lmspd pull`` converts the
    bundled model), in the test cache beside it; a marker file says the conversion finished."""
    from lmspd.models.gguf import convert_gguf

    gguf = cached_gguf(shape, seed, tokenizer_from)
    out = gguf.parent / f"{shape.name}-s{seed}"
    marker = out / ".converted"
    with cache_lock("big"):
        if not marker.exists():
            convert_gguf(gguf, out)
            marker.write_text(json.dumps(asdict(shape)) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "out", type=Path, nargs="?", help="where to write the GGUF (default: the test cache, converted too)"
    )
    parser.add_argument("--tiny", action="store_true", help="the tests' few-MB shape instead of the 1B one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path, default=SMOL_GGUF, help="the GGUF whose tokenizer to copy")
    args = parser.parse_args()
    shape = TINY if args.tiny else BIG
    print(f"{shape.name}: {parameter_count(shape) / 1e9:.3f}B parameters")
    if args.out:
        print(write_gguf(args.out, shape, args.seed, args.tokenizer_from))
        return
    print(cached_gguf(shape, args.seed, args.tokenizer_from))
    print(cached_model_dir(shape, args.seed, args.tokenizer_from))


if __name__ == "__main__":
    main()
