"""The service layer under every HTTP surface: /v1/responses, /v1/chat/completions and
/lmsp/v1/tasks are views of the same operations, implemented once here.

A request becomes a durable task (``submit``); readers wait on it (``wait``), follow
its event log (``follow``) or read its response object (``snapshot``); ``cancel``
settles it; ``abandon`` is what happens when the client of a foreground request
goes away. Handlers translate HTTP to these calls and errors back to HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Coroutine
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import ulid

from lmspd.config import Config
from lmspd.core import compactor
from lmspd.core.hub import Hub
from lmspd.core.inputs import resolve
from lmspd.core.lifecycle import ModelView
from lmspd.core.summary import ServerState, server_state
from lmspd.core.supervisor import Supervisor
from lmspd.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    LmspdError,
    ModelNotFoundError,
    NotFoundError,
    ServerOverloadedError,
    StorageFullError,
    TaskNotCancelableError,
)
from lmspd.metrics import Metrics
from lmspd.models.footprint import refuse_oversized
from lmspd.models.registry import ModelInfo, ModelRegistry
from lmspd.models.sampling import SamplingDefaults
from lmspd.prompting.generation import (
    cache_key,
    check_request,
    count_tokens,
    prompt_for,
    refuse_by_size,
    user_text_bytes,
)
from lmspd.responses import items as listed
from lmspd.responses import schema as s
from lmspd.responses.builder import ResponseState, initial_response
from lmspd.responses.compaction import default_keep_tokens
from lmspd.responses.enforce import SchemaBudget, check_directives
from lmspd.responses.history import history
from lmspd.responses.inputs import Item, item_json
from lmspd.responses.reasoning_echo import ReasoningEcho
from lmspd.responses.sealing import Sealer
from lmspd.store.items import ItemIndex
from lmspd.store.status import ACTIVE, TERMINAL, OnRestart
from lmspd.store.task_store import Event, NewEvent, ResponseFields, TaskRecord, TaskStore

if TYPE_CHECKING:
    from lmspd.core.cluster import Cluster

log = logging.getLogger("lmspd.core")
Kind = Literal["task", "response"]
_INLINE_CHECK_BYTES = 16 * 1024
# A cancel the full storage refused is tried again after this, doubling up to the last.
FIRST_RETRY_SECS, LAST_RETRY_SECS = 0.5, 8.0


class Core:
    def __init__(
        self,
        config: Config,
        store: TaskStore,
        hub: Hub,
        supervisor: Supervisor,
        registry: ModelRegistry,
        metrics: Metrics | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.hub = hub
        self.supervisor = supervisor
        self.cluster: Cluster | None = None  # on PostgreSQL: this node among the others
        self.registry = registry
        self.metrics = metrics or store.metrics
        self.echo = ReasoningEcho.of(config, store.db)
        self.sealer = sealer or Sealer.at(config.server.database_path.parent)
        self.items = ItemIndex(store.db)
        self.budget = SchemaBudget.of(config.responses)
        self.accepting = True
        self._limits_enforced_at = 0.0
        self._chores: set[asyncio.Task[None]] = set()  # abandoned requests still settling

    # --- lifecycle ------------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """Stop intake and end every event stream (clients resume with Last-Event-ID)."""
        self.accepting = False
        self.hub.close()

    async def close(self) -> None:
        self.begin_shutdown()
        for chore in list(self._chores):
            chore.cancel()
        await asyncio.gather(*self._chores, return_exceptions=True)

    # --- intake ---------------------------------------------------------------------------------

    async def submit(
        self,
        owner: str,
        request: s.ResponseRequest,
        *,
        kind: Kind,
        on_restart: OnRestart = "fail",
        idempotency: tuple[str, str] | None = None,
    ) -> tuple[TaskRecord, bool]:
        """Accept a validated request as a durable task; returns (task, replayed).

        Everything that would make the task fail anyway (unknown history, model, too
        long a prompt, the store's limits) is a client error here, before anything is
        written."""
        if not self.accepting:
            raise ServerOverloadedError("the server is shutting down")
        received = time.perf_counter()
        background = kind == "task" or request.background
        self._admit(request, background)
        turns: list[Item] = []
        if request.previous_response_id is not None or request.conversation is not None:
            turns = await history(self.store, owner, request.previous_response_id, request.conversation_id)
        request = await resolve(request, owner, self.items, self.sealer)
        # Stored as sent, its input resolved (and, once checked, with its model's sampling defaults):
        # the supervisor reads it back as a TaskRequest (a superset).
        encoded = msgspec.json.encode(request)
        # Checked as it will run: with the reasoning the echo puts back.
        turns, rendered, _ = await self.echo.restore(owner, turns, request)
        here = await self._served_here(request.model)
        if len(encoded) < _INLINE_CHECK_BYTES and not turns and not _has_schemas(request):
            defaults = self._check(rendered, turns, here)  # small and no grammar to check: cheaper than a thread hop
        else:
            defaults = await asyncio.to_thread(self._check, rendered, turns, here)
        if defaults is not None:  # stored with it: a resumed task samples as it began
            request = s.TaskRequest.of(request, sampling_defaults=defaults)
            encoded = msgspec.json.encode(request)
        model = request.model or self.config.default_model
        limits = self.config.responses
        stored = request.store and self.store_enabled and limits.store_max_bytes > 0
        expires = int(time.time()) + limits.background_ephemeral_ttl_secs if background and not request.store else None

        def first(task: TaskRecord, seq: int) -> NewEvent:
            response = initial_response(
                request, response_id=task.response_id, model=model, created_at=task.created_at, background=background
            )
            return ResponseState(response).created()[0](task, seq)

        def waiting(task: TaskRecord, seq: int) -> NewEvent:
            response = initial_response(
                request, response_id=task.response_id, model=model, created_at=task.created_at, background=background
            )
            return ResponseState(response).queued()(task, seq)

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
        self.supervisor.wake()
        return task, replayed

    @property
    def store_enabled(self) -> bool:
        return self.config.responses.store_max_entries > 0

    def require_store(self, param: str) -> None:
        if not self.store_enabled:
            raise InvalidRequestError("the response store is disabled (store_max_entries = 0)", param=param)

    def _admit(self, request: s.ResponseRequest, background: bool) -> None:
        """The seed's switches: what the store settings disable outright."""
        limits = self.config.responses
        if request.previous_response_id is not None:
            self.require_store("previous_response_id")
        if request.conversation is not None and limits.conversation_store_max_entries == 0:
            raise InvalidRequestError(
                "conversations are disabled (conversation_store_max_entries = 0)", param="conversation"
            )
        if request.background and 0 in (limits.background_max_jobs, limits.store_max_entries, limits.store_max_bytes):
            raise InvalidRequestError("background mode is disabled by the response store settings", param="background")

    async def _served_here(self, name: str | None) -> bool:
        """Whether this node checks the request against its model: yes, unless (PostgreSQL) only
        other live nodes serve it; a model no live node serves is refused as on one node."""
        if self.cluster is None or name is None:
            return True
        try:
            self.registry.check_requested(name)
            return True
        except ModelNotFoundError:
            if name in await self.cluster.live_models():
                return False
            raise

    def _check(self, request: s.ResponseRequest, turns: list[Item], here: bool = True) -> SamplingDefaults | None:
        """Runs in a worker thread: rendering a large prompt, taking schemas apart and compiling
        grammars (seconds for a large one) must not stall the event loop. Returns the model's
        sampling defaults, what the request samples with where it names nothing (None: known
        only to the node that runs it)."""
        check_directives(request.directives, self.budget)
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
            check_request(model, prompt_for(model, request, turns), sampling, check_length=check)
        return defaults

    async def input_tokens(self, owner: str, request: s.ResponseRequest) -> int:
        """The prompt's length in tokens, for a request create would accept: refused as
        create refuses it (its sampling parameters too), never counted regardless."""
        request.sampling().validate()
        turns = await history(self.store, owner, request.previous_response_id, request.conversation_id)
        request = await resolve(request, owner, self.items, self.sealer)
        turns, request, _ = await self.echo.restore(owner, turns, request)

        def count() -> int:
            check_directives(request.directives, self.budget)
            self.registry.check_requested(request.model)
            model = self.registry.resolve(request.model or self.config.default_model)
            refuse_by_size(model, user_text_bytes(request))
            return count_tokens(model, prompt_for(model, request, turns).text)

        return await asyncio.to_thread(count)

    def models(self) -> list[ModelInfo]:
        return self.registry.list()

    # --- models over a long life (lmspd.core.lifecycle) ------------------------------------------

    async def model_views(self) -> list[ModelView]:
        return await self.supervisor.lifecycle.views()

    async def load_model(self, name: str) -> ModelView:
        return await self.supervisor.lifecycle.load(name, self.supervisor.slots)

    async def unload_model(self, name: str, *, force: bool) -> ModelView:
        """Refused (409, nothing changed) while tasks run on it, unless ``force`` cancels them."""
        lifecycle, slots = self.supervisor.lifecycle, self.supervisor.slots
        return await lifecycle.unload(name, slots, force=force, cancel=lambda task_id: self.cancel(task_id, None))

    async def pin_model(self, name: str, pinned: bool) -> ModelView:
        return await self.supervisor.lifecycle.pin(name, pinned)

    def recycle_engine(self) -> bool:
        """An operator's engine recycle (lmspd.core.recycle); False: one is under way already."""
        return self.supervisor.recycle("operator")

    def not_ready(self) -> str | None:
        """Why ``/readyz`` answers 503 (None: ready). Read on every probe: nothing here loads
        or reads a model (the default model's verdict was decided at its preload)."""
        if not self.accepting:
            return "the server is shutting down"
        if not self.supervisor.engine.alive:
            return "the engine is down (it is restarted)"
        return self.supervisor.default_refused

    async def summary(self, owner: str) -> ServerState:
        """``GET /lmsp/v1/summary`` (the console's server page): ``owner``'s task counts, the
        models, the engine and the recent speed (lmspd.core.summary)."""
        return await server_state(
            owner, store=self.store, supervisor=self.supervisor, metrics=self.metrics, not_ready=self.not_ready()
        )

    async def metrics_text(self) -> bytes:
        """``/metrics``: the Prometheus text exposition."""
        await self.supervisor.lifecycle.observe()
        return await self.metrics.render(self.store, engine_alive=self.supervisor.engine.alive)

    # --- compaction -----------------------------------------------------------------------------

    async def compact(self, owner: str, body: s.CompactRequest) -> s.CompactResponse:
        """``POST /v1/responses/compact``: summarize the history in ``body.input`` into one
        compaction item. Stores nothing; the summary is one greedy generation on the engine."""
        if not self.accepting:
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

    async def past_compaction(self, task: TaskRecord) -> None:
        """A foreground request with ``context_management``: wait until its task is past
        compaction, so a refusal is an HTTP error (seed: compaction ends before the stream
        opens). A refused task is deleted: the client never learns its id."""
        async for batch in self.follow(task.id, -1):
            for ev in batch:
                if ev.type in ("response.created", "response.queued", "response.in_progress", "mlx.compaction.started"):
                    continue
                if ev.type == "response.failed":
                    final = await self.store.get(task.id)
                    problem = msgspec.json.decode(final.error) if final.error else {}
                    if problem.get("code") == "invalid_prompt":
                        await self.store.delete(task.id)
                        raise ContextLengthExceededError(str(problem.get("detail")), param="input")
                return

    # --- reading --------------------------------------------------------------------------------

    async def task(self, task_id: str, owner: str | None) -> TaskRecord:
        return await self.store.get(task_id, owner)

    async def tasks(
        self, owner: str, *, limit: int, after: str | None, statuses: list[str] | None
    ) -> tuple[list[TaskRecord], bool]:
        """A page of the owner's tasks, newest first, and whether more follow."""
        found = await self.store.list(owner, limit=limit + 1, after=after, statuses=statuses)
        return found[:limit], len(found) > limit

    async def response_task(self, response_id: str, owner: str) -> TaskRecord:
        """The task behind a response id, as /v1/responses/{id} sees it: a stored response
        or background job (a task's response included); foreground store:false ones are gone."""
        self.require_store("response_id")
        task = await self.store.get_by_response(response_id, owner)
        if task is None or (not task.stored and not task.background):
            raise NotFoundError(f"response '{response_id}' not found", param="response_id")
        return task

    async def snapshot(self, task: TaskRecord) -> bytes:
        """The response object as it stands: the final one once finished (kept with the task
        for every terminal state, as its events may be purged), else rebuilt from the log."""
        if task.response is not None:
            return task.response
        events = await self._all_events(task.id)
        if not events:  # a finished task whose log was purged (only rows older than this rule)
            raise NotFoundError(f"response '{task.response_id}' is no longer available", param="response_id")
        return ResponseState.from_events(events).encoded()

    async def _all_events(self, task_id: str) -> list[Event]:
        events: list[Event] = []
        after = -1
        while batch := await self.store.events_after(task_id, after, 5000):
            events += batch
            after = batch[-1].seq
        return events

    async def follow(
        self, task_id: str, after: int, batch_size: int = 1000, keepalive: float | None = None
    ) -> AsyncGenerator[list[Event], None]:
        """A task's events after ``after`` in batches of at most ``batch_size``, replayed then
        live, up to and including its final event. An empty batch means nothing happened for
        ``keepalive`` seconds (default ``keepalive_secs``). Ends early when the server shuts down."""
        keepalive = self.config.server.keepalive_secs if keepalive is None else keepalive
        while True:
            signal = self.hub.signal(task_id)  # taken before reading, so no commit slips between
            events = await self.store.events_after(task_id, after, batch_size)
            if events:
                final = next((i for i, ev in enumerate(events) if ev.type in s.FINAL_EVENTS), None)
                batch = events if final is None else events[: final + 1]
                yield batch
                if final is not None:
                    return
                after = batch[-1].seq
                continue
            if self.hub.closing.is_set():
                return
            if (await self.store.get(task_id)).status in TERMINAL:
                if not await self.store.events_after(task_id, after, 1):
                    return
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signal.wait(), keepalive)
                continue
            yield []

    async def wait(self, task_id: str) -> TaskRecord:
        """Until the task is finished."""
        while True:
            signal = self.hub.signal(task_id)
            task = await self.store.get(task_id)
            if task.status in TERMINAL:
                return task
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signal.wait(), 5.0)

    def stalled(self, task_id: str) -> bool:
        """A write of the task's failed for want of room: nothing more of it (not even its
        end) is written until there is room again."""
        return task_id in self.supervisor.storage.stalled

    async def outcome(self, task: TaskRecord) -> TaskRecord:
        """A synchronous request's wait: until its task is finished. With the storage full
        the task cannot go on, nor its end be written: StorageFullError (503) then, at once,
        rather than a wait for room that may never come; the task ends by its policy once
        there is room (``fail``: ``storage_full``), and is released then."""
        while True:
            signal = self.hub.signal(task.id)
            current = await self.store.get(task.id)
            if current.status in TERMINAL:
                return current
            if self.stalled(task.id):
                self.settle_later(current)
                raise StorageFullError(
                    f"the server's storage is full: response {task.response_id} cannot be completed now; "
                    "it ends by its policy once there is room (retry later)"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signal.wait(), 5.0)

    def settle_later(self, task: TaskRecord) -> None:
        """A foreground request answered before its task could end (the storage is full):
        once it has ended, release it. One that never started is cancelled (its client was
        told to retry, so it must not run); a started one ends by its policy."""
        self._chore(self._settle_later(task), f"settle {task.id}")

    async def _settle_later(self, task: TaskRecord) -> None:
        try:
            if task.status == "queued":
                await self._cancel_when_there_is_room(task.id)
            await self.release(await self.wait(task.id))
        except LmspdError as exc:  # gone already (deleted, purged): nothing left to settle
            log.info("task %s: %s", task.id, exc.message)

    # --- cancel ---------------------------------------------------------------------------------

    async def cancel(self, task_id: str, owner: str | None) -> TaskRecord:
        """docs/lmsp.md §7.3. A queued task is cancelled at once with its final events; a started one
        goes to ``cancelling`` and the supervisor settles it at the next decode step."""
        task = await self.store.get(task_id, owner)
        if task.status in TERMINAL or task.status == "cancelling":
            # Decided without the event log: a finished task's log may have been purged.
            if task.status in ("succeeded", "failed"):
                raise TaskNotCancelableError(f"task {task_id} already {task.status}")
            return task
        # The whole log: a task requeued by ``resume`` already streamed deltas.
        state = ResponseState.from_events(await self._all_events(task_id))
        final = state.cancelled()
        task = await self.store.cancel(task_id, owner, final_events=final, response=state.encoded())
        self.hub.notify(task_id)
        if task.status == "cancelling":
            await self.supervisor.cancel(task_id)
        return task

    async def cancel_and_wait(self, task_id: str, owner: str | None, timeout: float = 10.0) -> TaskRecord:
        """Cancel, then wait (bounded) for the engine to stop, so the caller sees the end."""
        task = await self.cancel(task_id, owner)
        if task.status in ACTIVE:
            with contextlib.suppress(TimeoutError):
                task = await asyncio.wait_for(self.wait(task_id), timeout)
        return task

    def abandon(self, task: TaskRecord) -> None:
        """The client of a foreground request went away: cancel it, and forget it once it
        ends if it was not to be stored. Runs detached: the request's own scope is cancelled.
        A stream that ends because the server is shutting down was not abandoned by its
        client: the task stays as it is, for its on_restart policy after the restart."""
        if self.hub.closing.is_set():
            return
        self._chore(self._abandon(task), f"abandon {task.id}")

    def _chore(self, work: Coroutine[Any, Any, None], name: str) -> None:
        chore = asyncio.create_task(work, name=name)
        self._chores.add(chore)
        chore.add_done_callback(self._chores.discard)

    async def _abandon(self, task: TaskRecord) -> None:
        try:
            await self._cancel_when_there_is_room(task.id)
            await self.release(await self.wait(task.id))
        except LmspdError as exc:  # gone already (deleted, purged): nothing left to settle
            log.info("abandoned task %s: %s", task.id, exc.message)

    async def _cancel_when_there_is_room(self, task_id: str) -> None:
        """Cancel; with the storage full, again after a while, until it is written."""
        wait = FIRST_RETRY_SECS
        while True:
            try:
                await self.cancel(task_id, None)
                return
            except TaskNotCancelableError:
                return
            except StorageFullError:
                await asyncio.sleep(wait)
                wait = min(2 * wait, LAST_RETRY_SECS)

    async def release(self, task: TaskRecord) -> None:
        """A foreground request has read its finished response: drop it if not stored, and
        keep the store within its caps."""
        if not task.stored and not task.background:
            await self.store.delete(task.id)
        now = time.monotonic()
        if now - self._limits_enforced_at >= 1.0:  # cheap queries, but not on every request
            self._limits_enforced_at = now
            await self.store.enforce_response_limits(self.config.responses)

    async def delete(self, task: TaskRecord) -> None:
        if task.status not in TERMINAL:
            raise InvalidRequestError(
                f"response '{task.response_id}' has not finished: cancel it first", param="response_id"
            )
        await self.store.delete(task.id)

    async def input_items(self, task: TaskRecord) -> list[Any]:
        """The request's own input items, in order (not the history it continued)."""
        request = msgspec.json.decode(task.request, type=s.TaskRequest)
        return request.items()


def _has_schemas(request: s.ResponseRequest) -> bool:
    """Whether the request brings tools or a text format: schemas to check, a grammar to compile."""
    return bool(request.tools) or request.text is not None
