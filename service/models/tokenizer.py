"""Tokenizer and chat template of one model directory, without MLX.

The server side renders chat prompts and counts tokens with this; the engine
uses the same class for incremental detokenization, so both sides agree on ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmspd.errors import InvalidRequestError, LmspdError, ModelError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

# Special tokens that carry structure the server parses (reasoning blocks, tool calls):
# detokenized text keeps them, while other special tokens (turn ends, padding) are hidden.
MARKERS = frozenset(
    {
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "<|python_tag|>",
        "<|tool_call_start|>",
        "<|tool_call_end|>",
        "<|tool_list_start|>",
        "<|tool_list_end|>",
        "<longcat_think>",
        "</longcat_think>",
    }
)


# What ``render_chat`` passes a chat template itself: a client's chat_template_kwargs may not
# set these (a duplicate keyword is a TypeError; a replaced global breaks the template).
TEMPLATE_ARGUMENTS = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception"}
)


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"model directory {model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        self._path = path
        # Byte-level BPE: a vocabulary string spells one byte per character.
        self._byte_level = "ByteLevel" in repr(self._tok.pre_tokenizer)
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template_file = model_dir / "chat_template.jinja"
        template = self.config.get("chat_template")
        if template_file.is_file():
            template = template_file.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.eos_token_ids = self._eos_ids(model_dir)
        added = {i: t for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        # Special tokens by text: a grammar names them by id, the output parser by text.
        self.special_tokens: dict[str, int] = {t.content: i for i, t in added.items()}
        self._hidden = frozenset(i for i, t in added.items() if t.content not in MARKERS)

    def _eos_ids(self, model_dir: Path) -> list[int]:
        ids: list[int] = []
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and (i := self._tok.token_to_id(eos)) is not None:
            ids.append(i)
        cfg = model_dir / "config.json"
        if cfg.is_file():
            value = json.loads(cfg.read_text()).get("eos_token_id")
            for i in value if isinstance(value, list) else [value]:
                if isinstance(i, int) and i not in ids:
                    ids.append(i)
        return ids

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers.Tokenizer`` itself, for a reader that needs more of it than this
        class offers (the engine's logprobs spell tokens with it: engine/logprobs.py)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text).ids)

    def count(self, text: str) -> int:
        """How many tokens ``text`` is (without making a list of them)."""
        return len(self._encode(text))

    def _encode(self, text: str) -> Any:
        # The batch call: it releases the GIL while Rust tokenizes (``encode`` holds it for the
        # whole call, so one long prompt in a worker thread stalls the event loop too).
        return self._tok.encode_batch_fast([text], add_special_tokens=False)[0]

    @cached_property
    def max_bytes_per_token(self) -> float | None:
        """An upper bound on the UTF-8 bytes of text one token stands for, so that a text of
        more than ``context × this`` bytes cannot fit without tokenizing it; None when this
        tokenizer gives no such bound (one unknown token may cover any length of text)."""
        shrink = _shrink_bound(json.loads(self._path.read_text()))
        if shrink is None:
            return None
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        longest = max(
            (len(t.encode()) if t in added or not self._byte_level else len(t) for t in self.vocab), default=1
        )
        return float(longest * shrink)

    def decode(self, ids: Sequence[int]) -> str:
        kept = [i for i in ids if i not in self._hidden]
        return str(self._tok.decode(kept, skip_special_tokens=False))

    @cached_property
    def vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @cached_property
    def _template(self) -> Any:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self.chat_template is None:
            raise ModelError("the model has no chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        return env.from_string(self.chat_template)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render messages through the model's chat template (as transformers does)."""
        special = {k: self.config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in special.items()}
        try:
            rendered = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **special, **kwargs
            )
        except LmspdError:
            raise
        except Exception as exc:  # a jinja2 error, or a value of a shape the template cannot use
            raise InvalidRequestError(f"the chat template cannot render this request: {exc}", param="input") from exc
        return str(rendered)

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.encode(self.render_chat(messages, **kwargs))


# Pre-tokenizers that keep every byte of the text; normalizers by how much they may shrink
# it (Unicode normal forms compose up to three code points into one; lowercase may shorten).
_KEEPING = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Sequence"}
_SHRINKING = {"NFC": 3.0, "NFD": 3.0, "NFKC": 3.0, "NFKD": 3.0, "Lowercase": 3.0, "Prepend": 1.0, "Sequence": 1.0}


def _shrink_bound(spec: dict[str, Any]) -> float | None:
    """How many bytes of text one byte of the normalized text may stand for, in a
    tokenizer.json whose every byte ends up in some token; None if some may vanish (a
    normalizer or pre-tokenizer that drops text, unknown tokens fused or spanning words)."""
    model = spec.get("model") or {}
    if model.get("type") not in ("BPE", "Unigram"):
        return None  # WordPiece: one [UNK] stands for a whole word
    pre = spec.get("pre_tokenizer")
    byte_level = "ByteLevel" in json.dumps(pre)
    if not (byte_level or model.get("byte_fallback")) and (model.get("fuse_unk") or model.get("type") == "Unigram"):
        return None
    for node in _nodes(pre, "pretokenizers"):
        if node.get("type") not in _KEEPING and not (node.get("type") == "Split" and node.get("behavior") != "Removed"):
            return None
    factor = 1.0
    for node in _nodes(spec.get("normalizer"), "normalizers"):
        kind = node.get("type")
        if kind == "Replace":
            content = str(node.get("content", ""))
            pattern = node.get("pattern") or {}
            if not content or "Regex" in pattern:
                return None
            factor *= max(1.0, len(str(pattern.get("String", "")).encode()) / len(content.encode()))
        elif kind in _SHRINKING:
            factor *= _SHRINKING[kind]
        else:
            return None
    return factor


def _nodes(node: Any, children: str) -> list[dict[str, Any]]:
    if not isinstance(node, dict):
        return []
    return [node, *(n for child in node.get(children) or [] for n in _nodes(child, children))]


def _raise_template_error(message: str) -> None:
    # What a template refuses is the request's shape (roles that must alternate, say).
    raise InvalidRequestError(f"chat template error: {message}", param="input")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are valid UTF-8.

    Byte-level BPE tokens can split a multi-byte character; decoding a window
    that ends mid-character yields U+FFFD, so such text is held back until the
    next token completes it. Decoding a short window (not the whole output)
    keeps each step O(1) while leaving the tokenizer to handle spacing rules.
    """

    def __init__(self, tokenizer: Tokenizer, prefix: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self.ids: list[int] = list(prefix)
        self._prefix_offset = max(len(self.ids) - 6, 0)
        self._read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = decode(self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end)."""
        prefix_text = self._tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._tokenizer.decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
