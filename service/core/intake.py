"""Intake: a request becomes a durable task (``submit``), or is counted (``input_tokens``).

Everything that would make the task fail anyway (unknown history, model, too long a prompt, the
store's limits) is a client error here, before anything is written. The checks that render the
prompt or compile a grammar run in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec

from lmspd.config import Config
from lmspd.core.hub import Hub
from lmspd.core.inputs import resolve
from lmspd.core.reads import require_store, store_enabled
from lmspd.errors import InvalidRequestError, ModelNotFoundError, ServerOverloadedError
from lmspd.metrics import Metrics
from lmspd.models.footprint import refuse_oversized
from lmspd.models.registry import ModelRegistry
from lmspd.models.sampling import SamplingDefaults
from lmspd.prompting.generation import check_request, count_tokens, prompt_for, refuse_by_size, user_text_bytes
from lmspd.responses import schema as s
from lmspd.responses.builder import ResponseState, initial_response
from lmspd.responses.checks import Accepted
from lmspd.responses.enforce import SchemaBudget, check_directives
from lmspd.responses.history import history
from lmspd.responses.inputs import Item
from lmspd.responses.reasoning_echo import ReasoningEcho
from lmspd.responses.sealing import Sealer
from lmspd.responses.tools import Directives
from lmspd.store.items import ItemIndex
from lmspd.store.status import OnRestart
from lmspd.store.task_store import NewEvent, ResponseFields, TaskRecord, TaskStore

Kind = Literal["task", "response"]
_INLINE_CHECK_BYTES = 16 * 1024


class Intake:
    """``wake``: tells the supervisor a task is queued; ``live_models``: on PostgreSQL, what the
    live nodes serve (None: this node alone)."""

    def __init__(
        self,
        config: Config,
        store: TaskStore,
        hub: Hub,
        registry: ModelRegistry,
        metrics: Metrics,
        *,
        sealer: Sealer,
        echo: ReasoningEcho,
        items: ItemIndex,
        wake: Callable[[], None],
        live_models: Callable[[], Awaitable[set[str]]] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.hub = hub
        self.registry = registry
        self.metrics = metrics
        self.sealer = sealer
        self.echo = echo
        self.items = items
        self.wake = wake
        self.live_models = live_models
        self.budget = SchemaBudget.of(config.responses)

    async def submit(
        self,
        owner: str,
        accepted: Accepted[s.ResponseRequest],
        *,
        kind: Kind,
        on_restart: OnRestart = "fail",
        idempotency: tuple[str, str] | None = None,
    ) -> tuple[TaskRecord, bool]:
        """Accept a request :func:`~lmspd.responses.checks.accept` checked as a durable task;
        returns (task, replayed). Its directives, parsed there, are carried, never parsed again.

        Everything that would make the task fail anyway (unknown history, model, too
        long a prompt, the store's limits) is a client error here, before anything is
        written."""
        request, parsed = accepted.request, accepted.directives
        if self.hub.closing.is_set():
            raise ServerOverloadedError("the server is shutting down")
        received = time.perf_counter()
        background = kind == "task" or request.background
        self._admit(request, background)
        request, encoded = await self._checked(owner, request, parsed)
        model = request.model or self.config.default_model
        limits = self.config.responses
        stored = request.store and store_enabled(limits) and limits.store_max_bytes > 0
        expires = int(time.time()) + limits.background_ephemeral_ttl_secs if background and not request.store else None

        def opening(task: TaskRecord) -> ResponseState:
            return ResponseState(
                initial_response(
                    request,
                    response_id=task.response_id,
                    model=model,
                    created_at=task.created_at,
                    background=background,
                    parsed=parsed,
                )
            )

        def first(task: TaskRecord, seq: int) -> NewEvent:
            return opening(task).created()[0](task, seq)

        def waiting(task: TaskRecord, seq: int) -> NewEvent:
            return opening(task).queued()(task, seq)

        task, replayed = await self.store.create(
            owner=owner,
            request=encoded,
            on_restart=on_restart,
            first_event=first,
            # A background response or task is created ``queued`` already; a foreground one is
            # created ``in_progress`` and says so when it must wait for a slot first.
            waiting_event=None if background else waiting,
            slots=self.config.engine.max_concurrency,
            idempotency=idempotency,
            max_background=limits.background_max_jobs if kind == "response" else None,
            response=ResponseFields(
                kind=kind,
                background=background,
                stored=stored if kind == "response" else request.store,
                previous_response_id=request.previous_response_id,
                conversation=request.conversation_id,
                expires_at=expires,
                model=model,
                cache_key=request.prompt_cache_key,
            ),
        )
        if not replayed:
            self.metrics.first_token_stages.start(task.id, received)
            self.metrics.first_token_stages.mark(task.id, "intake")
        self.wake()
        return task, replayed

    async def _checked(
        self, owner: str, request: s.ResponseRequest, parsed: Directives
    ) -> tuple[s.ResponseRequest, bytes]:
        """The request as it is stored, and encoded: its input resolved and, once checked
        against its model as it will run, with the model's sampling defaults (the supervisor
        reads it back as a TaskRequest, a superset)."""
        turns: list[Item] = []
        if request.previous_response_id is not None or request.conversation is not None:
            turns = await history(self.store, owner, request.previous_response_id, request.conversation_id)
        request = await resolve(request, owner, self.items, self.sealer)
        encoded = msgspec.json.encode(request)
        # Checked as it will run: with the reasoning the echo puts back.
        turns, rendered, _ = await self.echo.restore(owner, turns, request)
        here = await self._served_here(request.model)
        if len(encoded) < _INLINE_CHECK_BYTES and not turns and not _has_schemas(request):
            # Small, and no grammar to compile: cheaper than a thread hop.
            defaults = self._check(rendered, parsed, turns, here)
        else:
            defaults = await asyncio.to_thread(self._check, rendered, parsed, turns, here)
        if defaults is None:
            return request, encoded
        request = s.TaskRequest.of(request, sampling_defaults=defaults)  # a resumed task samples as it began
        return request, msgspec.json.encode(request)

    def _admit(self, request: s.ResponseRequest, background: bool) -> None:
        """The seed's switches: what the store settings disable outright."""
        limits = self.config.responses
        if request.previous_response_id is not None:
            require_store(limits, "previous_response_id")
        if request.conversation is not None and limits.conversation_store_max_entries == 0:
            raise InvalidRequestError(
                "conversations are disabled (conversation_store_max_entries = 0)", param="conversation"
            )
        if request.background and 0 in (limits.background_max_jobs, limits.store_max_entries, limits.store_max_bytes):
            raise InvalidRequestError("background mode is disabled by the response store settings", param="background")

    async def _served_here(self, name: str | None) -> bool:
        """Whether this node checks the request against its model: yes, unless (PostgreSQL) only
        other live nodes serve it; a model no live node serves is refused as on one node."""
        if self.live_models is None or name is None:
            return True
        try:
            self.registry.check_requested(name)
            return True
        except ModelNotFoundError:
            if name in await self.live_models():
                return False
            raise

    def _check(
        self, request: s.ResponseRequest, parsed: Directives, turns: list[Item], here: bool = True
    ) -> SamplingDefaults | None:
        """Runs in a worker thread: rendering a large prompt, taking schemas apart and compiling
        grammars (seconds for a large one) must not stall the event loop. Returns the model's
        sampling defaults, what the request samples with where it names nothing (None: known
        only to the node that runs it)."""
        check_directives(parsed, self.budget)
        if not here:  # the node that claims it checks the prompt against the model as it runs
            request.sampling().validate()
            return None
        self.registry.check_requested(request.model)
        name = request.model or self.config.default_model
        model = self.registry.resolve_local(name)
        defaults = self.registry.sampling_defaults(name, model)
        sampling = request.sampling(defaults)
        if model is None:  # fetched when the task runs
            sampling.validate()
        else:
            # With context_management, a prompt too long is compacted (or the task fails).
            check = request.compact_threshold() is None
            refuse_oversized(model.name, model.path, self.config.engine)
            if check:
                refuse_by_size(model, user_text_bytes(request))
            check_request(model, prompt_for(model, request, turns, parsed=parsed), sampling, check_length=check)
        return defaults

    async def input_tokens(self, owner: str, accepted: Accepted[s.ResponseRequest]) -> int:
        """The prompt's length in tokens, for a request create would accept: refused as
        create refuses it (its sampling parameters too), never counted regardless."""
        request, parsed = accepted.request, accepted.directives
        request.sampling().validate()
        turns = await history(self.store, owner, request.previous_response_id, request.conversation_id)
        request = await resolve(request, owner, self.items, self.sealer)
        turns, request, _ = await self.echo.restore(owner, turns, request)

        def count() -> int:
            check_directives(parsed, self.budget)
            self.registry.check_requested(request.model)
            model = self.registry.resolve(request.model or self.config.default_model)
            refuse_by_size(model, user_text_bytes(request))
            return count_tokens(model, prompt_for(model, request, turns, parsed=parsed).text)

        return await asyncio.to_thread(count)


def _has_schemas(request: s.ResponseRequest) -> bool:
    """Whether the request brings tools or a text format: schemas to check, a grammar to compile."""
    return bool(request.tools) or request.text is not None
