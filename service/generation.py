"""Turn chat messages into an engine ``Generate`` command, checking limits first."""

from __future__ import annotations

from typing import Any

from service.engine import protocol as p
from service.errors import ContextLengthExceededError, InvalidRequestError
from service.models.registry import ResolvedModel
from service.tokenizer import Tokenizer

_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenizer_for(model: ResolvedModel) -> Tokenizer:
    key = str(model.path)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = Tokenizer(model.path)
    return _TOKENIZERS[key]


def _too_long(tokens: int, model: ResolvedModel) -> ContextLengthExceededError:
    return ContextLengthExceededError(
        f"the input is {tokens} tokens, but the model's context is {model.context_length} tokens", param="input"
    )


def check_request(
    model: ResolvedModel,
    messages: list[dict[str, Any]],
    sampling: p.SamplingParams,
    template_kwargs: dict[str, Any] | None = None,
) -> int | None:
    """Intake's check: what ``build_generate`` would reject, tokenizing only when needed.

    A byte-level BPE never makes more tokens than the text has bytes, so a short
    rendered prompt cannot exceed the context and needs no tokenization. Returns
    the token count when it was computed.
    """
    sampling.validate()
    tok = tokenizer_for(model)
    rendered = tok.render_chat(messages, **(template_kwargs or {}))
    if len(rendered.encode()) + 8 < model.context_length:
        return None
    if (tokens := len(tok.encode(rendered))) >= model.context_length:
        raise _too_long(tokens, model)
    return tokens


def build_generate(
    model: ResolvedModel,
    messages: list[dict[str, Any]],
    *,
    request_id: str,
    max_tokens: int,
    sampling: p.SamplingParams,
    generated: list[int] | None = None,
    stop: list[str] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    logprobs: int | None = None,
) -> p.Generate:
    """Validate, render and tokenize; raise before any generation on bad input."""
    sampling.validate()
    if max_tokens < 1:
        raise InvalidRequestError(f"max_output_tokens must be >= 1, got {max_tokens}", param="max_output_tokens")
    tok = tokenizer_for(model)
    prompt = tok.encode_chat(messages, **(template_kwargs or {}))
    if len(prompt) >= model.context_length:
        raise _too_long(len(prompt), model)
    return p.Generate(
        request_id=request_id,
        model=model.name,
        path=str(model.path),
        prompt=prompt,
        generated=generated or [],
        max_tokens=max_tokens,
        sampling=sampling,
        stop_token_ids=tok.eos_token_ids,
        stop=stop or [],
        logprobs=logprobs,
    )
