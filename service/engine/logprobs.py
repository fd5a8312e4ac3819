"""Logprobs as OpenAI reports them: each step's chosen-token logprob and top alternatives,
and each token's raw bytes and text (engine process only: it imports MLX lazily)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmspd.models.tokenizer import Tokenizer

# A logprob of -inf (a token no sampler could pick) travels as this, as OpenAI reports it.
LOGPROB_FLOOR = -9999.0


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: byte-level BPE spells each byte as one printable
    character; this maps those characters back to the bytes."""
    byte_values = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(byte_values)  # printable bytes stand for themselves
    shifted = 0
    for b in range(256):
        if b not in byte_values:  # the others are spelled 256, 257, ... in byte order
            byte_values.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(byte_values, chars, strict=True)}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def top_logprobs(
    rows: list[Any], tokens: list[int], ks: list[int]
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Each row's chosen-token logprob and its k most likely (id, logprob), most likely first.

    One partial sort and one evaluation for the whole step, not one per request.
    """
    import mlx.core as mx

    stacked = mx.stack(rows).astype(mx.float32)
    chosen = mx.take_along_axis(stacked, mx.array(tokens)[:, None], axis=-1)[:, 0]
    kmax = max(ks)
    if kmax == 0:
        return [_finite(v) for v in _to_list(chosen)], [[] for _ in ks]
    ids = mx.argpartition(-stacked, kth=kmax - 1, axis=-1)[:, :kmax]
    values = mx.take_along_axis(stacked, ids, axis=-1)
    mx.eval(chosen, ids, values)
    tops: list[list[tuple[int, float]]] = []
    for k, row_ids, row_values in zip(ks, _to_list(ids), _to_list(values), strict=True):
        # Ties go to the lower id, as argmax (the greedy sampler) breaks them.
        ranked = sorted(zip(row_ids, row_values, strict=True), key=lambda iv: (-iv[1], iv[0]))[:k]
        tops.append([(int(i), _finite(v)) for i, v in ranked])
    return [_finite(v) for v in _to_list(chosen)], tops


def _to_list(array: Any) -> list[Any]:
    return list(array.tolist())


def _finite(logprob: float) -> float:
    return max(min(float(logprob), 0.0), LOGPROB_FLOOR)


class TokenPieces:
    """Each token id's raw bytes and its text as logprobs report them (cached per id).

    Spelled by the model's own tokenizer, the one the engine already holds to detokenize:
    a second copy loaded from tokenizer.json held another 10 MB per model (docs/memory.md)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        from tokenizers import decoders

        self._tok = tokenizer.backend
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        # Added (special) tokens are stored as plain text, not in the byte alphabet.
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._raw(token_id)
            # OpenAI writes bytes that are not UTF-8 on their own (part of a character)
            # as \xNN escapes; `bytes` keeps them exact either way.
            found = self._cache[token_id] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return found

    def scored(self, token_id: int, logprob: float) -> tuple[str, float, list[int]]:
        """The fields of a TopLogprob, in order."""
        text, raw = self.piece(token_id)
        return text, logprob, raw

    def _raw(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        spelled: str | None = self._tok.id_to_token(token_id)
        if spelled is None:  # an embedding row past the tokenizer's vocabulary
            return b""
        if self._byte_level:
            return b"".join(bytes([_BYTE_LEVEL[c]]) if c in _BYTE_LEVEL else c.encode() for c in spelled)
        # SentencePiece-style vocabularies: <0xNN> byte fallback, U+2581 for a space.
        if m := _BYTE_FALLBACK.fullmatch(spelled):
            return bytes([int(m.group(1), 16)])
        return spelled.replace("\u2581", " ").encode()
