"""The supervisor: runs queued tasks on the engine and keeps their event logs.

It claims queued tasks in order (a compare-and-set to ``loading``), no more of a
model's at once than the engine decodes (its decode slots: a task reads ``running``
only while it is decoded, docs/lmsp.md §7.2), drives the engine, turns token deltas
into response events, persists them *before* waking any reader, applies
cancellation, and restarts a dead engine with backoff. Work interrupted by an engine
crash or a server restart follows the task's ``on_restart`` policy; every write that moves a
task, and that settling, is :class:`lmspd.core.transitions.Transitions`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable

import msgspec

from lmspd.config import Config
from lmspd.core import compactor
from lmspd.core.claim import Claim, Run
from lmspd.core.compactor import summary_id
from lmspd.core.hub import Hub
from lmspd.core.inputs import item_ids
from lmspd.core.lifecycle import ModelLifecycle
from lmspd.core.recycle import Recycler
from lmspd.core.storage_backoff import StorageBackoff
from lmspd.core.token_timer import TokenTimer
from lmspd.core.transitions import Transitions
from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.errors import (
    EngineCrashedError,
    EngineRecycledError,
    LeaseLostError,
    LmspdError,
    ModelTooLargeError,
    StorageFullError,
    StoreUnavailableError,
)
from lmspd.metrics import Metrics
from lmspd.models.footprint import refuse_oversized
from lmspd.models.registry import ModelRegistry, ResolvedModel
from lmspd.models.slots import DecodeSlots, ModelSlots
from lmspd.prompting.generation import build_generate, cache_key, prompt_for, tokenizer_for
from lmspd.responses import schema as s
from lmspd.responses.builder import ResponseState
from lmspd.responses.history import history as history_for
from lmspd.responses.inputs import Item
from lmspd.responses.reasoning_echo import ReasoningEcho
from lmspd.responses.schema import TaskRequest
from lmspd.responses.sealing import Sealer
from lmspd.store.conn import Conn
from lmspd.store.items import ItemIndex
from lmspd.store.task_store import TaskStore

log = logging.getLogger("lmspd.supervisor")

# Model spellings remembered with what they resolved to (forgotten all at once past this).
CANONICAL_NAMES_KEPT = 256


class Supervisor:
    def __init__(
        self,
        config: Config,
        store: TaskStore,
        engine: EngineClient,
        hub: Hub,
        registry: ModelRegistry,
        metrics: Metrics | None = None,
        sealer: Sealer | None = None,
        echo: ReasoningEcho | None = None,
        items: ItemIndex | None = None,
    ) -> None:
        """``sealer``, ``echo``, ``items``: the service's own, shared with intake (built here
        when left out, as tests that run a supervisor alone do)."""
        self.config = config
        self.store = store
        self.engine = engine
        self.hub = hub
        self.registry = registry
        self.metrics = metrics or store.metrics
        # Reasoning sealed for clients that keep no state (docs/responses.md, "Coding agents").
        self.sealer = sealer or Sealer.at(config.server.database_path.parent)
        self.echo = echo or ReasoningEcho.of(config, store.db)
        self.items = items or ItemIndex(store.db)
        self.running: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._backoff = 0.5
        self.slots = ModelSlots(config.engine.max_loaded_models)
        # What the engine decodes at once: a task is claimed running only with one of these.
        self.decoding = DecodeSlots(config.engine.max_concurrency)
        self._resolved: dict[str, ResolvedModel] = {}  # requested model name -> what it resolved to
        self.storage = StorageBackoff(config.server.database_path)
        # Every write that moves a task, and its settling by policy (lmspd.core.transitions).
        self.transitions = Transitions(store, hub, self.storage, lambda task_id: task_id in self.running)
        self.lifecycle = ModelLifecycle(config, engine, registry, self.metrics)
        self.recycler = Recycler(config.engine, self.metrics, lambda: self.engine, self._serve_on)
        self.compactor = compactor.TaskCompactor(self.transitions.commit, self.metrics)
        # Why the default model can never load (None: it can), decided once by preload from
        # its files and the memory budget, so /readyz reads it without touching the model.
        self.default_refused: str | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.transitions.recover()
        try:
            await self.engine.start()
        except EngineCrashedError as exc:
            if not self.config.engine.hosts:
                raise
            # A group waits for its hosts: the server serves (and /readyz says which host is
            # missing) while the loop starts the engine again (docs/distributed.md).
            log.error("the engine group did not form: %s", exc.message)
        self.engine.listeners.append(self.lifecycle.heard)
        if self.engine.alive:
            await self.lifecycle.configure()
            await self.preload()
        self._loop_task = asyncio.create_task(self._loop(), name="supervisor")

    def use_engine(self, engine: EngineClient) -> None:
        """New generations go to ``engine`` from now on (an engine recycle)."""
        self.engine = engine
        self.lifecycle.engine = engine
        self.decoding.next_engine()

    async def _serve_on(self, engine: EngineClient) -> None:
        """A recycle's next engine: new generations go to it, set up as a restarted one is."""
        self.use_engine(engine)
        await self.lifecycle.configure()
        await self.preload()
        self.wake()

    def recycle(self, reason: str = "operator") -> bool:
        """Replace the engine while serving (lmspd.core.recycle); False: one is under way."""
        return self.recycler.start(reason)

    async def preload(self) -> None:
        """Load the default model now, so the first task does not wait for it; then [engine]
        preload's, each warmed by one short prefill (the server is ready only after this)."""
        default = self.config.default_model
        try:
            model = await asyncio.to_thread(self.registry.resolve_local, default)
            if model is not None:
                # The memory budget's verdict, as intake gives it (lmspd.models.footprint): a model
                # that cannot fit even alone never loads, so the server is not ready while it
                # serves on (docs/operations.md, "Readiness"). No load is tried for it.
                await asyncio.to_thread(refuse_oversized, model.name, model.path, self.config.engine)
                self.default_refused = None
                await self.engine.load(model.name, str(model.path))
        except ModelTooLargeError as exc:
            self.default_refused = f"the default model cannot load: {exc.message}"
            log.error("not ready: %s", self.default_refused, extra={"model": default, "code": exc.code, "ready": False})
        except LmspdError as exc:  # tasks naming it will fail with the reason; others still run
            log.error("default model %s did not load: %s", self.config.default_model, exc.message)
        for name in self.config.engine.preload:
            try:
                await self.lifecycle.preload(name)
            except LmspdError as exc:
                log.error("preloading model %s failed: %s", name, exc.message)

    async def stop(self, *, close_engine: bool = True) -> None:
        """Leave in-flight tasks as their policies can recover them, then stop the engine
        (unless it was handed in by the caller, who then owns it)."""
        self._stopping = True
        with contextlib.suppress(ValueError):  # a shared engine outlives this supervisor
            self.engine.listeners.remove(self.lifecycle.heard)
        if self._loop_task:
            self._loop_task.cancel()
        for task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        await self.recycler.close()
        if close_engine or self.recycler.replaced:  # an engine the recycler started is ours
            await self.engine.close()

    def wake(self) -> None:
        self._wake.set()

    async def lease_lost(self) -> None:
        """This node's lease was taken over (lmspd.core.cluster): its tasks are another node's,
        so every generation here stops now, writing nothing (the writes are fenced anyway)."""
        for task_id, task in list(self.running.items()):
            with contextlib.suppress(Exception):
                await self.engine.cancel(task_id)
                await self.engine.cancel(summary_id(task_id))
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def _loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            if not self.engine.alive:
                await self._restart_engine()
                continue
            if (why := await self.recycler.due()) is not None:
                self.recycler.start(why)
            if self.storage.active and not await self.transitions.settle_stalled():
                continue
            room = 2 * self.config.engine.max_concurrency - len(self.running)
            if room <= 0:
                continue
            try:
                queued = await self.store.queued_ids(room + len(self.running))
            except StoreUnavailableError as exc:  # PostgreSQL away: this loop must outlive it
                log.warning("the queue cannot be read (%s); again in 1s", exc.message)
                await asyncio.sleep(1.0)
                self.wake()
                continue
            for task_id in queued:
                if task_id not in self.running and room > 0:
                    self.running[task_id] = asyncio.create_task(self._run(task_id), name=f"run {task_id}")
                    room -= 1

    async def _restart_engine(self) -> None:
        log.warning("restarting the engine in %.1fs", self._backoff)
        await asyncio.sleep(self._backoff)
        try:
            await self.engine.start()
            self._backoff = 0.5
            self.metrics.engine_restarts.inc()
            await self.lifecycle.configure()  # a new engine knows no pins yet
        except Exception:
            log.exception("engine restart failed")
            self._backoff = min(self._backoff * 2, 30.0)
        self.wake()

    # --- running one task -----------------------------------------------------------------------

    async def cancel(self, task_id: str) -> None:
        """The task went to ``cancelling``: stop its generation (it then becomes ``cancelled``)."""
        await self.engine.cancel(task_id)
        await self.engine.cancel(summary_id(task_id))
        for old in self.recycler.draining:  # still generating on an engine being replaced
            for request_id in (task_id, summary_id(task_id)):
                if old.running(request_id):
                    await old.cancel(request_id)
        if task_id not in self.running:
            self.wake()

    async def _run(self, task_id: str) -> None:
        try:
            await self._run_inner(task_id)
        except asyncio.CancelledError:
            raise
        except StorageFullError:
            self.storage.full(task_id)
        except LeaseLostError as exc:  # another node took the task over: stop, write nothing
            log.warning("task %s: %s; its generation here stops", task_id, exc.message)
            with contextlib.suppress(Exception):
                await self.engine.cancel(task_id)
        except Exception:
            log.exception("task %s failed unexpectedly", task_id)
            with contextlib.suppress(Exception):
                if (state := await self.transitions.state(await self.store.get(task_id))) is not None:
                    await self.transitions.fail(task_id, state, "server_error", "internal error while running the task")
        finally:
            self.running.pop(task_id, None)
            self.decoding.release(task_id)
            self.slots.release(task_id)
            self.engine.forget(task_id)  # a cancel that came before a Generate that never went
            self.engine.forget(summary_id(task_id))
            self.hub.notify(task_id)
            self.wake()

    async def _run_inner(self, task_id: str) -> None:
        task = await self.store.get(task_id)
        # Several nodes (PostgreSQL): claimed first, always, before anything else is read or
        # started, so a node that loses the claim to another has spent one write on it and never
        # starts the generation (a task never runs on two nodes at once).
        clustered = self.store.fence.me is not None
        if clustered and not await self.transitions.to(task_id, "loading", []):
            return  # another node's (or cancelled) first
        if (state := await self.transitions.state(task)) is None:
            return
        request = msgspec.json.decode(task.request, type=TaskRequest)
        # The model named at intake (PostgreSQL: the accepting node's default, if it named none).
        name = task.model or request.model or self.config.default_model
        if (claim := await self._claim(task_id, state, name, clustered)) is None:
            return
        try:
            await self._serve(Run(task, state, request, name, claim))
        finally:
            await claim.settled()  # before anything else may touch the task

    async def _claim(self, task_id: str, state: ResponseState, name: str, clustered: bool) -> Claim | None:
        """The task, claimed: ahead, on a model already in memory, else to ``loading`` (None:
        cancelled or claimed elsewhere first).

        A model already in memory: claimed and running in one commit, with no round trip to
        an engine that answers only between its decode steps. (The engine knows models by
        their canonical names; a spelling seen before maps to one without resolving it.)
        That commit is written while the prompt is prepared and prefilled: time to first
        token does not wait for its fsync, and nothing of the task's is committed (nor any
        other state of it touched) before it has landed."""
        known = self._resolved.get(name)
        canonical = known.name if known is not None else name
        if clustered or not self.engine.resident(canonical):
            return Claim() if clustered or await self.transitions.to(task_id, "loading", []) else None
        # Running means decoding (docs/lmsp.md §7.2): past max_concurrency, a task waits
        # here, queued, rather than in the engine's own queue reading running.
        waited = await self.slots.acquire(task_id, canonical)  # given back when _run ends
        waited = await self.decoding.acquire(task_id, canonical) or waited
        claim = Claim(
            asyncio.ensure_future(self.transitions.to(task_id, "running", state.in_progress(), via="loading"))
        )
        if waited and not await claim.held():
            return None  # cancelled while it waited: no generation starts for it
        return claim

    async def _serve(self, run: Run) -> None:
        """Run a claimed task, then settle it by how its generation ended: each ending is a
        transition of its own, written only if the claim held."""
        ending: Callable[[], Awaitable[None]]
        try:
            finished = await self._produce(run)
        except (StorageFullError, LeaseLostError):
            # Storage: not the task's fault, it is settled by its policy once there is room.
            # Lease: another node's task now, nothing more is written into it from here.
            raise
        except EngineCrashedError as exc:
            ending = functools.partial(self._crashed, run, exc)
        except LmspdError as exc:
            ending = functools.partial(self.transitions.fail, run.id, run.state, exc.code, exc.message)
        else:
            if finished is None:
                return
            ending = functools.partial(self._finished, run, finished)
        if await run.claim.held():
            await ending()

    async def _produce(self, run: Run) -> p.Finished | None:
        """The steps from claim to the generation's end; None: the run stops here (the task
        was settled on the way, or is someone else's)."""
        model = await self._model(run)
        if not await self._running(run, model):
            return None
        self.metrics.first_token_stages.mark(run.id, "claim")
        history = await self._history(run)
        max_tokens = run.request.max_output_tokens or self.config.server.default_max_output_tokens
        after: list[Item] = []
        if (threshold := run.request.compact_threshold()) is not None:
            if not await run.claim.held():
                return None
            compacted = await self.compactor.run(self.engine, run.state, self._job(run, model, history, threshold))
            if compacted is None:
                await self.transitions.cancelled(run.id, run.state)
                return None
            after, input_tokens = compacted
            # Generation is capped by the context left after the prompt (length: incomplete).
            max_tokens = min(max_tokens, model.context_length - input_tokens)
        cmd = await self._command(run, model, history, after, max_tokens)
        self.metrics.first_token_stages.mark(run.id, "prompt")
        return await self._generate(run.id, run.state, cmd, run.claim)

    async def _model(self, run: Run) -> ResolvedModel:
        """What the run's model name resolves to. A resident model was resolved when it was
        loaded: its files are not read again (the engine holds its weights), which keeps a
        thread hop off the first token."""
        model = self._resolved.get(run.name) if run.claim.ahead else None
        if model is None:
            model = await asyncio.to_thread(self.registry.resolve, run.name)
            if len(self._resolved) >= CANONICAL_NAMES_KEPT:
                self._resolved.clear()
            self._resolved[run.name] = model
        return model

    async def _running(self, run: Run, model: ResolvedModel) -> bool:
        """A task claimed after loading: its slots, its model loaded, then ``running``. False:
        cancelled meanwhile, and settled so. (A claim ahead took its slots before its commit.)"""
        if run.claim.ahead:
            return True
        await self.slots.acquire(run.id, model.name)  # given back when _run ends
        await self.decoding.acquire(run.id, model.name)
        await self.engine.load(model.name, str(model.path))
        if await self.transitions.to(run.id, "running", run.state.in_progress()):
            return True
        await self.transitions.cancelled(run.id, run.state)
        return False

    async def _history(self, run: Run) -> list[Item]:
        """The turns the task continues, with the reasoning a client dropped from turns it sends
        back put back first (into ``run.request`` too)."""
        task = run.task
        history = await history_for(
            self.store, task.owner, task.previous_response_id, task.conversation, before=task.id
        )
        history, run.request, run.echoed = await self.echo.restore(task.owner, history, run.request)
        return history

    def _job(self, run: Run, model: ResolvedModel, history: list[Item], threshold: int) -> compactor.TaskInput:
        key = cache_key(run.task.owner, run.request.prompt_cache_key)
        return compactor.TaskInput(run.id, model, run.request, history, threshold, key)

    async def _command(
        self, run: Run, model: ResolvedModel, history: list[Item], after: list[Item], max_tokens: int
    ) -> p.Generate:
        """The prompt, its parser attached to the response, and the engine's Generate for it."""
        request, state = run.request, run.state
        prompt = await asyncio.to_thread(prompt_for, model, request, history, after)
        seal = None
        if request.sealed_reasoning:
            owner, sealer = run.task.owner, self.sealer
            seal = lambda item_id, text: sealer.seal(owner, item_id, text)  # noqa: E731
        # A resumed task: the parser catches up with the text already generated.
        generated = tokenizer_for(model).decode(state.tokens)
        state.outputs.attach(prompt.parser(), generated, prompt.tools.namespaces, seal)
        return await asyncio.to_thread(  # tokenizing a long prompt takes a while
            build_generate,
            model,
            prompt,
            request_id=run.id,
            max_tokens=max_tokens,
            # The defaults stored at intake, else (not known there) this model's.
            sampling=request.sampling(request.sampling_defaults or self.registry.sampling_defaults(run.name, model)),
            generated=state.tokens,
            stop=request.stop,
            logprobs=request.logprobs,
            cache_key=cache_key(run.task.owner, request.prompt_cache_key),
        )

    # --- how a run ends: each transition its own ------------------------------------------------

    async def _finished(self, run: Run, finished: p.Finished) -> None:
        """The generation ended: ``succeeded`` (with the echo's and the item index's rows), or
        ``cancelled`` if a cancel stopped it or came first."""
        state, task = run.state, run.task
        if finished.reason == "cancelled":
            return await self.transitions.cancelled(run.id, state)
        events = state.finish(finished.reason, finished.prompt_tokens, finished.cached_tokens, finished.stop_sequence)
        jobs = [self.echo.finish_job(task.owner, state.response, run.echoed)]
        if task.kind == "response" and task.stored:  # its items can be referenced (item_reference)
            jobs.append(self.items.job(task.owner, run.id, item_ids(run.request, state.response)))
        if not await self.transitions.final(run.id, "succeeded", events, state, also=_all(jobs)):
            await self.transitions.cancelled(run.id, state)

    async def _crashed(self, run: Run, exc: EngineCrashedError) -> None:
        """The engine died (or was recycled) under the generation."""
        task = await self.store.get(run.id)
        if task.status == "cancelling":
            return await self.transitions.cancelled(run.id, run.state)
        if isinstance(exc, EngineRecycledError):  # the server did not restart: resume, whatever the policy
            return await self.transitions.resume(run.id)
        await self.transitions.interrupted(task, run.state, "engine_crashed", exc.message)

    async def _generate(self, task_id: str, state: ResponseState, cmd: p.Generate, claim: Claim) -> p.Finished | None:
        """Stream the generation, committing each batch of deltas before it is published;
        None (the generation stopped) if the claim did not hold."""
        queue: asyncio.Queue[p.Delta | p.Finished | Exception] = asyncio.Queue()

        async def pump() -> None:
            timer = TokenTimer(self.metrics, task_id)
            try:
                async for ev in self.engine.generate(cmd):
                    timer.saw(ev)
                    queue.put_nowait(ev)
            except Exception as exc:  # handed to the consumer, which re-raises it
                queue.put_nowait(exc)

        producer = asyncio.create_task(pump())
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():  # group what arrived while the last commit ran
                    items.append(queue.get_nowait())
                text, tokens, logprobs = "", [], []
                end: p.Finished | None = None
                for item in items:
                    if isinstance(item, Exception):
                        raise item
                    if isinstance(item, p.Finished):
                        end = item
                        text += item.text
                    else:
                        text += item.text
                        tokens += item.token_ids
                        logprobs += [s.LogProb.of(entry) for entry in item.logprobs or []]
                if (text or tokens) and (events := state.delta(text, tokens, logprobs)):
                    if not await claim.held():
                        return None
                    await self.transitions.commit(task_id, events)
                    self.metrics.first_token_stages.mark(task_id, "commit")
                if end is not None:
                    return end
        finally:
            producer.cancel()
            with contextlib.suppress(BaseException):
                await producer


def _all(jobs: list[Callable[[Conn], None] | None]) -> Callable[[Conn], None] | None:
    """One job running ``jobs`` (None ones left out) in the transaction that finishes a task."""
    todo = [job for job in jobs if job is not None]
    if not todo:
        return None

    def run(conn: Conn) -> None:
        for job in todo:
            job(conn)

    return run
