"""Compaction on a model: count, split, summarize, check (shared by ``POST /v1/responses/compact``
and ``context_management``). The pure rules are in :mod:`service.responses.compaction`.

Every refusal (a history longer than the context, a summary that does not fit, a compacted
context that is not shorter) is a :class:`ContextLengthExceededError`, raised before
anything is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine import protocol as p
from .engine.client import EngineClient
from .errors import ContextLengthExceededError, EngineError
from .generation import build_generate, count_tokens, prompt_for, tokenizer_for
from .models.registry import ResolvedModel
from .responses import compaction
from .responses.inputs import CompactionItem, Item, encode_payload
from .responses.schema import ResponseRequest

GREEDY = p.SamplingParams(temperature=0.0)


def count(model: ResolvedModel, request: ResponseRequest, history: list[Item], after: list[Item] | None = None) -> int:
    """The rendered input's tokens, as ``/v1/responses/input_tokens`` counts them."""
    return tokenizer_for(model).count(prompt_for(model, request, history, after).text)


@dataclass(frozen=True)
class Prepared:
    plan: compaction.Plan
    generate: p.Generate  # the summarising generation
    before: int  # input tokens before compaction


def prepare(
    model: ResolvedModel,
    request: ResponseRequest,
    history: list[Item],
    *,
    keep_tokens: int,
    max_summary_tokens: int,
    request_id: str,
    cache_key: str,
    before: int | None = None,
) -> Prepared:
    """Split the history and build the summarising generation (runs in a worker thread)."""
    tok = tokenizer_for(model)
    context = model.context_length
    if before is None:  # what cannot fit is refused by its size, before it is tokenized
        before = count_tokens(model, prompt_for(model, request, history).text)
    if before >= context:
        raise ContextLengthExceededError(
            f"the history is {before} tokens, longer than the model's context ({context} tokens): "
            "it cannot be summarized in one pass",
            param="input",
        )
    plan = compaction.plan(
        [*history, *request.items()],
        keep_tokens,
        lambda items: tok.count(compaction.transcript(None, items)),
    )
    messages = compaction.summary_messages(plan)
    prompt = len(tok.encode_chat(messages))
    if prompt >= context:
        raise ContextLengthExceededError(
            f"the summarising prompt is {prompt} tokens, longer than the model's context ({context} tokens)",
            param="input",
        )
    cmd = build_generate(
        model,
        messages,
        request_id=request_id,
        max_tokens=min(max_summary_tokens, context - prompt),
        sampling=GREEDY,
        cache_key=cache_key,
    )
    return Prepared(plan, cmd, before)


async def summarize(engine: EngineClient, model: ResolvedModel, cmd: p.Generate) -> tuple[str, p.Finished]:
    """One non-streaming generation; its text, and how it ended (possibly ``cancelled``)."""
    await engine.load(model.name, str(model.path))
    text = ""
    finished: p.Finished | None = None
    async for ev in engine.generate(cmd):
        text += ev.text
        if isinstance(ev, p.Finished):
            finished = ev
    if finished is None:
        raise EngineError("the summarising generation ended without finishing")
    return text.strip(), finished


def item(prepared: Prepared, summary: str, item_id: str) -> CompactionItem:
    return CompactionItem(
        type="compaction", id=item_id, encrypted_content=encode_payload(summary, prepared.plan.preserved)
    )


def require_shorter(before: int, after: int) -> None:
    if after >= before:
        raise ContextLengthExceededError(
            f"compacting does not make the context shorter ({after} tokens after, {before} before)", param="input"
        )
