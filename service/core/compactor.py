"""Compaction on a model: count, split, summarize, check (shared by ``POST /v1/responses/compact``
and ``context_management``). The pure rules are in :mod:`lmspd.responses.compaction`.

Every refusal (a history longer than the context, a summary that does not fit, a compacted
context that is not shorter) is a :class:`ContextLengthExceededError`, raised before
anything is kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import ulid

from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.errors import ContextLengthExceededError, EngineError, InvalidPromptError
from lmspd.metrics import Metrics
from lmspd.models.registry import ResolvedModel
from lmspd.prompting.generation import build_generate, count_tokens, prompt_for, tokenizer_for
from lmspd.responses import compaction
from lmspd.responses.builder import ResponseState
from lmspd.responses.inputs import CompactionItem, Item, encode_payload
from lmspd.responses.schema import ResponseRequest
from lmspd.store.task_store import EventBuilder

Commit = Callable[[str, list[EventBuilder]], Awaitable[None]]

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


def summary_id(task_id: str) -> str:
    """The engine request id of a task's compaction summary (cancelled with the task)."""
    return f"{task_id}.compaction"


@dataclass(frozen=True)
class TaskInput:
    """A task's input as ``context_management`` compacts it."""

    task_id: str
    model: ResolvedModel
    request: ResponseRequest
    history: list[Item]
    threshold: int
    cache_key: str


class TaskCompactor:
    """``context_management``: compaction inside a task, its progress written into the task's
    event log by ``commit`` (the supervisor's, which wakes the task's readers)."""

    def __init__(self, commit: Commit, metrics: Metrics) -> None:
        self.commit = commit
        self.metrics = metrics

    async def run(self, engine: EngineClient, state: ResponseState, job: TaskInput) -> tuple[list[Item], int] | None:
        """Compact the history before generating when the rendered input reaches the threshold
        or leaves no room for output. Returns the items that follow the request's own (the
        compaction item, or none) and the input's tokens; None if the task was cancelled
        meanwhile. Durable: once ``mlx.compaction.completed`` and the item are committed, a
        resumed task reuses them."""
        model, request, history, threshold = job.model, job.request, job.history, job.threshold
        if state.outputs.compacted:
            done = state.outputs.items[0]
            after: list[Item] = [CompactionItem(type="compaction", id=done.id, encrypted_content=done.text)]
            return after, await asyncio.to_thread(count, model, request, history, after)
        before = await asyncio.to_thread(count, model, request, history)
        if before < min(threshold, model.context_length - 1):
            return [], before
        if state.compaction_started is None:
            await self.commit(job.task_id, state.compaction_begins(before))
        item_id = f"cmp_{ulid.new()}"
        if (made := await self._summarize(engine, job, before, item_id)) is None:
            return None
        compacted, input_tokens = made
        await self.commit(
            job.task_id, state.compaction_done(item_id, compacted.encrypted_content, before, input_tokens)
        )
        self.metrics.compactions.labels("task").inc()
        return [compacted], input_tokens

    async def _summarize(
        self, engine: EngineClient, job: TaskInput, before: int, item_id: str
    ) -> tuple[CompactionItem, int] | None:
        """The compaction item and the compacted input's tokens (None: cancelled)."""
        model, request, history, threshold = job.model, job.request, job.history, job.threshold
        # The verbatim tail and the summary each get at most a quarter of the threshold, so the
        # compacted input lands well below it and the next turn does not compact again at once.
        keep = min(compaction.default_keep_tokens(model.context_length), max(1, threshold // 4))
        try:
            prepared = await asyncio.to_thread(
                prepare,
                model,
                request,
                history,
                keep_tokens=keep,
                max_summary_tokens=min(1024, max(1, threshold // 4)),
                request_id=summary_id(job.task_id),
                cache_key=job.cache_key,
                before=before,
            )
            summary, finished = await summarize(engine, model, prepared.generate)
            if finished.reason == "cancelled":
                return None
            made = item(prepared, summary, item_id)
            input_tokens = await asyncio.to_thread(count, model, request, history, [made])
            require_shorter(before, input_tokens)
        except ContextLengthExceededError as exc:
            # Seed: a job whose automatic compaction refused the request fails invalid_prompt.
            raise InvalidPromptError(f"compaction failed: {exc.message}", param=exc.param) from exc
        return made, input_tokens
