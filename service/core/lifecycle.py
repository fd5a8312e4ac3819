"""Models over a long life: what is loaded, preloading, and operators' load, unload and pin.

The engine decides idle unloads itself (it knows when each model's last request ended) and
reports what it holds when asked (:meth:`EngineClient.status`); this side keeps what must
survive an engine restart (pins, per-model keep-alives), counts loads and unloads, and
answers the model-control routes. Models are known to the engine by their canonical names
(:meth:`ModelRegistry.resolve`); a control call may use any spelling of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import msgspec

from lmspd.config import Config
from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.errors import LmspdError, ModelBusyError
from lmspd.metrics import Metrics
from lmspd.models.registry import ModelRegistry, ResolvedModel
from lmspd.models.sampling import SamplingDefaults
from lmspd.models.slots import ModelSlots
from lmspd.prompting.generation import tokenizer_for

# What a preloaded model is warmed with: one short prefill (its first request then finds
# the model's buffers allocated and its kernels built).
WARM_UP_TEXT = "Hello"


class ModelView(msgspec.Struct, kw_only=True):
    """One model as ``GET /lmsp/v1/models`` shows it."""

    id: str
    ready: bool  # its files are here (a built-in pulled): it can be loaded
    loaded: bool = False
    resident_bytes: int = 0  # its weights as the engine holds them (per weight_dtype)
    weight_dtype: str | None = None
    numerics: str | None = None  # its products': "exact" or "fast" (docs/numerics.md)
    running: int = 0  # requests generating on it now
    last_used_at: int | None = None  # unix seconds its last request ended (now while in use)
    unload_at: int | None = None  # unix seconds it will be unloaded if still idle (None: not due)
    keep_alive_secs: float = 0.0
    pinned: bool = False
    # What a request on it samples with where it names nothing (docs/operations.md, "Sampling
    # defaults"); None: not known until its files are here (a hub model not downloaded yet).
    sampling_defaults: SamplingDefaults | None = None
    hosts: list[p.HostShare] | None = None  # split over a group: each host's part


class ModelLifecycle:
    def __init__(self, config: Config, engine: EngineClient, registry: ModelRegistry, metrics: Metrics) -> None:
        self.config = config
        self.engine = engine
        self.registry = registry
        self.metrics = metrics
        self.pinned: set[str] = set()  # canonical names; sent again to a restarted engine

    # --- the engine's side --------------------------------------------------------------------

    async def configure(self) -> None:
        """Tell a (new) engine each configured model's keep-alive and the pins."""
        for alias, entry in self.config.models.items():
            if entry.keep_alive_secs is None:
                continue
            self.engine.keep_alive[alias] = entry.keep_alive_secs
            with contextlib.suppress(LmspdError):  # not here yet: it gets it when it is
                if (model := await asyncio.to_thread(self.registry.resolve_local, alias)) is not None:
                    self.engine.keep_alive[model.name] = entry.keep_alive_secs
        for name in sorted(self.pinned):
            await self.engine.pin(name, True)

    def heard(self, event: str, model: str, reason: str) -> None:
        """The engine loaded or unloaded a model (EngineClient.listeners)."""
        if event == "loaded":
            self.metrics.model_loads.labels(model).inc()
        elif event == "unloaded":
            self.metrics.model_unloads.labels(reason).inc()

    async def observe(self) -> None:
        """The scrape-time gauges: the engine's RSS and each loaded model's bytes."""
        if not self.engine.alive:
            return
        with contextlib.suppress(LmspdError):
            status = await self.engine.status()
            self.metrics.observe_engine(
                status.rss_bytes,
                {m.model: m.resident_bytes for m in status.models if m.loaded},
                {
                    m.model: [(h.rank, h.host, h.resident_bytes, h.layers[1] - h.layers[0]) for h in m.hosts]
                    for m in status.models
                    if m.loaded and m.hosts
                },
            )

    async def preload(self, name: str) -> None:
        """Load ``name`` and warm it with one short prefill."""
        model = await asyncio.to_thread(self.registry.resolve, name)
        await self.engine.load(model.name, str(model.path))
        prompt = await asyncio.to_thread(lambda: tokenizer_for(model).encode(WARM_UP_TEXT))
        cmd = p.Generate(
            request_id=f"warm-up {model.name}", model=model.name, path=str(model.path), prompt=prompt, max_tokens=1
        )
        async for _ in self.engine.generate(cmd):
            pass

    # --- the operator's side ------------------------------------------------------------------

    async def _canonical(self, name: str) -> tuple[str, ResolvedModel | None]:
        """The engine's name for ``name`` and the model, if its files are here;
        ModelNotFoundError (404, naming it) for a model nobody configured."""
        self.registry.check_requested(name)
        model = await asyncio.to_thread(self.registry.resolve_local, name)
        return (model.name if model is not None else name), model

    async def views(self) -> list[ModelView]:
        status: p.EngineStatus | None = None
        with contextlib.suppress(LmspdError):  # an engine down (or dying now): nothing is loaded
            status = await self.engine.status() if self.engine.alive else None
        states = {m.model: m for m in status.models} if status is not None else {}
        views: list[ModelView] = []
        seen: set[str] = set()
        for info in self.registry.list():
            canonical, defaults = await asyncio.to_thread(self._describe, info.name, info.pulled)
            views.append(self._view(info.name, info.pulled, states.get(canonical), canonical, defaults))
            seen.add(canonical)
        # Loaded under a name the list does not show (a directory a request named).
        for n, m in states.items():
            if m.loaded and n not in seen:
                views.append(self._view(n, True, m, n, (await asyncio.to_thread(self._describe, n, True))[1]))
        return views

    def _describe(self, name: str, here: bool) -> tuple[str, SamplingDefaults | None]:
        """A listed model's canonical name and sampling defaults (its files are read: in a thread)."""
        model = None
        with contextlib.suppress(LmspdError):
            model = self.registry.resolve_local(name) if here else None
        return (model.name if model is not None else name), self.registry.sampling_defaults(name, model)

    def _view(
        self, name: str, ready: bool, state: p.ModelState | None, canonical: str, defaults: SamplingDefaults | None
    ) -> ModelView:
        keep = self.engine.keep_alive.get(
            canonical, self.engine.keep_alive.get(name, self.config.engine.keep_alive_secs)
        )
        if state is None or not state.loaded:
            return ModelView(
                id=name, ready=ready, keep_alive_secs=keep, pinned=canonical in self.pinned, sampling_defaults=defaults
            )
        now = time.time()
        return ModelView(
            id=name,
            ready=ready,
            sampling_defaults=defaults,
            loaded=True,
            resident_bytes=state.resident_bytes,
            weight_dtype=state.weight_dtype,
            numerics=state.numerics,
            running=state.running,
            last_used_at=int(now - (state.idle_secs or 0.0)),
            unload_at=None if state.unload_in_secs is None else int(now + state.unload_in_secs),
            keep_alive_secs=state.keep_alive_secs,
            pinned=state.pinned,
            hosts=state.hosts or None,
        )

    async def view(self, name: str) -> ModelView:
        canonical, _ = await self._canonical(name)
        for v in await self.views():
            if v.id == name:
                return v
        return self._view(name, True, None, canonical, (await asyncio.to_thread(self._describe, name, True))[1])

    async def load(self, name: str, slots: ModelSlots) -> ModelView:
        """Load ``name`` now (pulling a built-in first); it waits, as tasks do, for a slot."""
        _, model = await self._canonical(name)
        if model is None:  # a built-in not pulled yet, a configured hub id not downloaded yet
            model = await asyncio.to_thread(self.registry.resolve, name)
        holder = f"operator load {model.name} {time.monotonic_ns()}"
        await slots.acquire(holder, model.name)
        try:
            await self.engine.load(model.name, str(model.path))
        finally:
            slots.release(holder)
        return await self.view(name)

    async def unload(
        self, name: str, slots: ModelSlots, *, force: bool, cancel: Callable[[str], Awaitable[object]]
    ) -> ModelView:
        """Unload ``name`` now; ModelBusyError (nothing changed) while tasks run on it,
        unless ``force``, which cancels them."""
        canonical, _ = await self._canonical(name)
        holders = slots.holders_of(canonical)
        if holders and not force:
            raise ModelBusyError(
                f"model '{name}' has {len(holders)} running task(s); unload with ?force=true to cancel them",
                param="model",
            )
        for holder in holders:
            with contextlib.suppress(LmspdError):  # a compaction's or an operator's holder
                await cancel(holder)
        if self.engine.alive:
            await self.engine.unload(canonical, force=True)
        return await self.view(name)

    async def pin(self, name: str, pinned: bool) -> ModelView:
        canonical, _ = await self._canonical(name)
        (self.pinned.add if pinned else self.pinned.discard)(canonical)
        if self.engine.alive:
            await self.engine.pin(canonical, pinned)
        return await self.view(name)
