"""``POST /v1/responses/compact``: a history summarized into one compaction item, nothing stored
(the steps on the model are :mod:`lmspd.core.compactor`'s, shared with ``context_management``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ulid

from lmspd.config import Config
from lmspd.core import compactor
from lmspd.core.hub import Hub
from lmspd.core.inputs import resolve
from lmspd.core.supervisor import Supervisor
from lmspd.errors import ServerOverloadedError
from lmspd.metrics import Metrics
from lmspd.models.registry import ModelRegistry
from lmspd.prompting.generation import cache_key, refuse_by_size, user_text_bytes
from lmspd.responses import items as listed
from lmspd.responses import schema as s
from lmspd.responses.compaction import default_keep_tokens
from lmspd.responses.inputs import Item, item_json
from lmspd.responses.sealing import Sealer
from lmspd.store.items import ItemIndex


class Compaction:
    """``supervisor``: its engine, and the decode slots a summary shares with the tasks."""

    def __init__(
        self,
        config: Config,
        hub: Hub,
        registry: ModelRegistry,
        supervisor: Supervisor,
        metrics: Metrics,
        *,
        sealer: Sealer,
        items: ItemIndex,
    ) -> None:
        self.config = config
        self.hub = hub
        self.registry = registry
        self.supervisor = supervisor
        self.metrics = metrics
        self.sealer = sealer
        self.items = items

    async def compact(self, owner: str, body: s.CompactRequest) -> s.CompactResponse:
        """``POST /v1/responses/compact``: summarize the history in ``body.input`` into one
        compaction item. Stores nothing; the summary is one greedy generation on the engine."""
        if self.hub.closing.is_set():
            raise ServerOverloadedError("the server is shutting down")
        # Resolved as create resolves it: a reference or a seal create refuses, this refuses too.
        request = await resolve(body.request(), owner, self.items, self.sealer)
        model_name = body.model or self.config.default_model
        response_id, item_id = f"resp_{ulid.new()}", f"cmp_{ulid.new()}"
        created_at = int(time.time())

        def prepare() -> tuple[Any, compactor.Prepared]:
            self.registry.check_requested(body.model)
            model = self.registry.resolve(model_name)
            refuse_by_size(model, user_text_bytes(request))  # it must fit to be summarized
            keep = body.keep_tokens or default_keep_tokens(model.context_length)
            prepared = compactor.prepare(
                model,
                request,
                [],
                keep_tokens=keep,
                max_summary_tokens=body.max_output_tokens,
                request_id=item_id,
                cache_key=cache_key(owner, body.prompt_cache_key),
            )
            return model, prepared

        model, prepared = await asyncio.to_thread(prepare)
        # Straight to the engine (nothing durable to keep), within the tasks' decode slots: at
        # most as many generations at once as the engine decodes, so a compaction never keeps a
        # task that reads running waiting in the engine's queue (docs/lmsp.md §7.2).
        await self.supervisor.slots.acquire(item_id, model.name)
        try:
            await self.supervisor.decoding.acquire(item_id, model.name)
            summary, finished = await compactor.summarize(self.supervisor.engine, model, prepared.generate)
        finally:
            self.supervisor.decoding.release(item_id)
            self.supervisor.slots.release(item_id)
        if finished.reason == "cancelled":
            raise ServerOverloadedError("the summarising generation was cancelled")
        item = compactor.item(prepared, summary, item_id)
        output: list[Item] = [*prepared.plan.system, *prepared.plan.preserved, item]

        def check() -> None:
            compacted = s.ResponseRequest(input=[item_json(i) for i in output], instructions=body.instructions)
            compactor.require_shorter(prepared.before, compactor.count(model, compacted, []))

        await asyncio.to_thread(check)
        self.metrics.compactions.labels("endpoint").inc()
        usage = s.Usage(
            input_tokens=finished.prompt_tokens,
            output_tokens=finished.completion_tokens,
            total_tokens=finished.prompt_tokens + finished.completion_tokens,
        )
        return s.CompactResponse(
            id=response_id,
            created_at=created_at,
            model=model_name,
            output=listed.resources(response_id, output),
            usage=usage,
        )
