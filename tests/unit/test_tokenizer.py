"""Tokenizer: ids equal a from-scratch BPE over the GGUF vocabulary; chat template; detokenizer."""

from __future__ import annotations

import itertools
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import regex

from lmspd.models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "What is the capital of France?",
    "Hello, world! It's 2026-11-30 and 12345 apples cost $3.99.",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "naïve café — Ünïcödé 😀 日本語のテキスト",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nHi<|im_end|>\n",
]

_GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@cache
def _byte_to_unicode() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


class ReferenceBPE:
    """A textbook GPT-2 byte-level BPE built straight from the GGUF metadata."""

    def __init__(self, metadata: dict[str, Any]) -> None:
        self.tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(metadata["tokenizer.ggml.merges"])}
        types = metadata["tokenizer.ggml.token_type"].tolist()
        self.special = [self.tokens[i] for i, t in enumerate(types) if t == 3]

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def _encode_plain(self, text: str) -> list[int]:
        ids: list[int] = []
        b2u = _byte_to_unicode()
        for piece in regex.findall(r"\p{N}|[^\p{N}]+", text):  # Digits(individual_digits=True)
            for word in _GPT2_SPLIT.findall(piece):
                mapped = "".join(b2u[b] for b in word.encode("utf-8"))
                ids.extend(self.vocab[p] for p in self._bpe(mapped))
        return ids

    def encode(self, text: str) -> list[int]:
        pattern = "(" + "|".join(regex.escape(s) for s in self.special) + ")"
        ids: list[int] = []
        for chunk in regex.split(pattern, text):
            if chunk in self.vocab and chunk in self.special:
                ids.append(self.vocab[chunk])
            elif chunk:
                ids.extend(self._encode_plain(chunk))
        return ids


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> ReferenceBPE:
    import mlx.core as mx

    _, metadata = mx.load(str(gguf_path), return_metadata=True)
    assert isinstance(metadata, dict)
    return ReferenceBPE(metadata)


@pytest.fixture(scope="module")
def tok(smol_dir: Path) -> Tokenizer:
    return Tokenizer(smol_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_reference_bpe(tok: Tokenizer, reference: ReferenceBPE, text: str) -> None:
    assert tok.encode(text) == reference.encode(text)


def test_known_encoding(tok: Tokenizer) -> None:
    # Fixed ids of the chat prompt, as llama.cpp's and transformers' tokenizers give them.
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert ids[:20] == [
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        5646,
        11173,
        3365,
        3511,
        308,
        34519,
        28,
        7018,
        411,
        407,
        19712,
        8182,
        2,
    ]
    assert len(ids) == 37


def test_chat_template_renders_like_transformers(tok: Tokenizer, smol_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(smol_dir / "tokenizer.json"))  # type: ignore[no-untyped-call]
    hf.chat_template = tok.chat_template
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ]
    for messages in conversations:
        ours = tok.render_chat(messages)
        assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.endswith("<|im_start|>assistant\n")


def test_chat_template_default_system_prompt(tok: Tokenizer) -> None:
    rendered = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_eos_is_im_end(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>")] == [2]


@pytest.mark.parametrize("text", TEXTS[:5])
def test_incremental_detokenizer_is_exact_and_utf8_safe(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text


def test_detokenizer_holds_back_split_characters(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # one emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_detokenizer_resumes_after_a_prefix(tok: Tokenizer) -> None:
    ids = tok.encode("The capital of France is Paris.")
    detok = IncrementalDetokenizer(tok, prefix=ids[:3])
    assert (
        "".join(detok.add(i) for i in ids[3:]) + detok.flush()
        == tok.decode(ids[3:])
        == tok.decode(ids)[len(tok.decode(ids[:3])) :]
    )
