"""Turn a prompt (or plain chat messages) into an engine ``Generate`` command, checking limits first."""

from __future__ import annotations

import json
import math
from typing import Any

from lmspd.engine import protocol as p
from lmspd.errors import ContextLengthExceededError, InvalidRequestError
from lmspd.models.registry import ResolvedModel
from lmspd.models.tokenizer import Tokenizer
from lmspd.prompting.prompt import Prompt, build_prompt
from lmspd.responses.enforce import check_lark
from lmspd.responses.inputs import Item
from lmspd.responses.schema import ResponseRequest
from lmspd.responses.tools import Directives

_TOKENIZERS: dict[str, Tokenizer] = {}


def tokenizer_for(model: ResolvedModel) -> Tokenizer:
    key = str(model.path)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = Tokenizer(model.path)
    return _TOKENIZERS[key]


def cache_key(owner: str, prompt_cache_key: str | None) -> str:
    """The engine prompt cache's namespace: cached prefixes are shared within one client, and
    within it by ``prompt_cache_key`` when one is given (OpenAI's hint for which requests share
    a prefix). Never across clients: a cache hit is faster, so sharing would let one client
    time another's prompts."""
    return json.dumps([owner, prompt_cache_key or ""])


def _too_long(tokens: int, model: ResolvedModel) -> ContextLengthExceededError:
    # The prompt must leave room for one token of output: it may hold context_length - 1.
    return ContextLengthExceededError(
        f"the input is {tokens} tokens, but the model's context is {model.context_length} tokens",
        param="input",
        tokens=tokens,
        maximum=model.context_length - 1,
    )


def count_tokens(model: ResolvedModel, text: str) -> int:
    """``text``'s length in tokens; ContextLengthExceededError at once, without tokenizing,
    when its size alone shows it cannot fit the context (a megabyte prompt is seconds of
    tokenizer work, and nothing but an error comes of it)."""
    refuse_by_size(model, len(text.encode()))
    return tokenizer_for(model).count(text)


def refuse_by_size(model: ResolvedModel, size: int) -> None:
    """ContextLengthExceededError if a prompt of at least ``size`` bytes cannot fit."""
    per = tokenizer_for(model).max_bytes_per_token
    if per is not None and size > per * model.context_length:
        raise ContextLengthExceededError(
            f"the input is {size} bytes, more than the model's context of {model.context_length} tokens "
            f"can hold (a token is at most {per:.0f} bytes)",
            param="input",
            tokens=math.ceil(size / per),  # at least this many
            maximum=model.context_length - 1,
        )


def user_text_bytes(request: ResponseRequest) -> int:
    """A lower bound on the rendered prompt's size, known before rendering it (rendering a
    megabyte holds the GIL for a while): the user's own text, which every template renders."""
    if isinstance(request.input, str):
        return len(request.input.encode())
    size = 0
    for item in request.input:
        if not isinstance(item, dict) or item.get("role") != "user" or item.get("type", "message") != "message":
            continue
        content = item.get("content")
        parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            size += len(text.encode()) if isinstance(text, str) else 0
    return size


def prompt_for(
    model: ResolvedModel,
    request: ResponseRequest,
    history: list[Item],
    after: list[Item] | None = None,
    parsed: Directives | None = None,
) -> Prompt:
    return build_prompt(tokenizer_for(model), request, history, after, parsed)


def _text(tok: Tokenizer, prompt: Prompt | list[dict[str, Any]], template_kwargs: dict[str, Any] | None) -> str:
    return prompt.text if isinstance(prompt, Prompt) else tok.render_chat(prompt, **(template_kwargs or {}))


def check_request(
    model: ResolvedModel,
    prompt: Prompt | list[dict[str, Any]],
    sampling: p.SamplingParams,
    template_kwargs: dict[str, Any] | None = None,
    *,
    check_length: bool = True,
) -> int | None:
    """Intake's check: what ``build_generate`` would reject, tokenizing only when needed.

    A byte-level BPE never makes more tokens than the text has bytes, so a short
    rendered prompt cannot exceed the context and needs no tokenization. Returns
    the token count when it was computed.
    """
    sampling.validate()
    if isinstance(prompt, Prompt) and prompt.grammar is not None:
        check_lark(prompt.grammar, prompt.grammar_param)
    tok = tokenizer_for(model)
    rendered = _text(tok, prompt, template_kwargs)
    if not check_length or len(rendered.encode()) + 8 < model.context_length:
        return None
    if (tokens := count_tokens(model, rendered)) >= model.context_length:
        raise _too_long(tokens, model)
    return tokens


def build_generate(
    model: ResolvedModel,
    prompt: Prompt | list[dict[str, Any]],
    *,
    request_id: str,
    max_tokens: int,
    sampling: p.SamplingParams,
    generated: list[int] | None = None,
    stop: list[str] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    logprobs: int | None = None,
    cache_key: str = "",
) -> p.Generate:
    """Validate, render and tokenize; raise before any generation on bad input."""
    sampling.validate()
    if max_tokens < 1:
        raise InvalidRequestError(f"max_output_tokens must be >= 1, got {max_tokens}", param="max_output_tokens")
    tok = tokenizer_for(model)
    ids = tok.encode(_text(tok, prompt, template_kwargs))
    if len(ids) >= model.context_length:
        raise _too_long(len(ids), model)
    return p.Generate(
        request_id=request_id,
        model=model.name,
        path=str(model.path),
        prompt=ids,
        generated=generated or [],
        max_tokens=max_tokens,
        sampling=sampling,
        stop_token_ids=tok.eos_token_ids,
        stop=stop or [],
        logprobs=logprobs,
        grammar=prompt.grammar if isinstance(prompt, Prompt) else None,
        cache_key=cache_key,
    )
