"""Which models the engine holds: loading (a ``LoadModel`` now, or once busy models leave
room), eviction within the memory budget, idle unload, an operator's unload and pin, and the
status report (docs/operations.md, "Models over a long life").

``Residency`` is handed the engine's ``send``, its prompt cache (trimmed to what the models
leave) and its ``Requests`` (an operator's forced unload cancels a model's requests, and a
model a grammar compiles for is not idle); worker.Engine composes it with the rest.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import TYPE_CHECKING

from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.lifecycle import Lifecycle, MemoryBudget, release_memory, resident_bytes, rss_bytes
from lmspd.engine.loaded import BUFFER_CACHE_BYTES, LoadedModel, bound_buffer_cache
from lmspd.engine.pacing import PrefillPacer
from lmspd.engine.requests import Requests, Send
from lmspd.errors import LmspdError
from lmspd.models.registry import context_length_of
from lmspd.models.tokenizer import Tokenizer

if TYPE_CHECKING:  # it imports MLX, which the server process never does (engine/worker.py)
    from lmspd.engine.group.ring import Group
    from lmspd.engine.prompt_cache import PromptCache

log = logging.getLogger("lmspd.engine")


class Residency:
    """The loaded models, least recently used first, and what decides when they go."""

    def __init__(self, config: EngineConfig, send: Send, prompt_cache: PromptCache, requests: Requests) -> None:
        self.send = send
        self.prompt_cache = prompt_cache
        self.requests = requests
        self.max_concurrency = config.max_concurrency
        self.max_loaded_models = config.max_loaded_models
        self.weight_dtype = config.weight_dtype
        self.numerics = config.numerics
        self.kernel_dir = config.kernel_dir
        self.buffer_cache = BUFFER_CACHE_BYTES
        self.prefill_step_size = config.prefill_step_size
        self.prefill_interleave_s = config.prefill_interleave_ms / 1000
        self.models: OrderedDict[str, LoadedModel] = OrderedDict()  # least recently used first
        self.pending_loads: deque[p.LoadModel] = deque()  # loads waiting for a busy model's room
        self.lifecycle = Lifecycle(config.keep_alive_secs)
        self.budget = MemoryBudget(config)
        # The engine's group of hosts (engine/group), None in one process: models load split
        # by layers, the same file on every host; none is unloaded for being idle (a clock
        # would decide that differently on each host).
        self.group: Group | None = None
        self.host_layers = config.host_layers
        # Memory freed (a model gone, a load's transients) not yet given back (release_freed).
        self.release_due = False

    # --- commands -----------------------------------------------------------------------------

    def load_command(self, cmd: p.LoadModel) -> None:
        if cmd.keep_alive_secs is not None:
            self.lifecycle.keep_alive[cmd.model] = cmd.keep_alive_secs
        if self.budget.fits_alone(cmd.path) and not self.can_load(cmd.model, cmd.path):
            self.pending_loads.append(cmd)  # busy models hold the memory: loaded once they are done
            return
        was_loaded = cmd.model in self.models
        lm = self.load_or_fail(cmd.model, cmd.path)
        if lm is not None and was_loaded:  # a caller is waiting for this answer
            self.lifecycle.touch(lm.name)  # loaded for a request on its way: not idle now
            self.send(
                p.ModelLoaded(
                    model=cmd.model,
                    weight_dtype=lm.weight_dtype,
                    numerics=lm.numerics,
                    seconds=0.0,
                    resident_bytes=lm.resident_bytes,
                )
            )

    def retry_loads(self) -> None:
        """The loads that waited for room, each taken again (it waits on if there is none yet)."""
        for _ in range(len(self.pending_loads)):
            load = self.pending_loads.popleft()
            if self.can_load(load.model, load.path):
                self.load_command(load)
            else:
                self.pending_loads.append(load)

    def pin(self, cmd: p.PinModel) -> None:
        (self.lifecycle.pinned.add if cmd.pinned else self.lifecycle.pinned.discard)(cmd.model)

    # --- models -----------------------------------------------------------------------------

    def load_or_fail(self, name: str, path: str) -> LoadedModel | None:
        try:
            return self._load(name, path)
        except Exception as exc:  # report any load failure; the engine itself stays up
            log.exception("loading %s failed", name)
            code = exc.code if isinstance(exc, LmspdError) else "model_load_failed"
            self.send(
                p.Failed(
                    request_id=None, code=code, message=f"cannot load model '{name}': {exc}", param="model", model=name
                )
            )
            return None

    def _load(self, name: str, path: str) -> LoadedModel:
        if name in self.models:
            self.models.move_to_end(name)
            return self.models[name]
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.utils import load_model

        from lmspd.engine.packed import packed_matrix_bytes
        from lmspd.engine.prompt_cache import model_fingerprint
        from lmspd.engine.weights import apply_numerics, apply_weight_dtype, weight_file_bytes

        if (refused := self.budget.refusal(name, path)) is not None:
            raise refused
        self._evict_for_one(path)
        self.send(p.ModelLoading(name))
        start = time.perf_counter()
        if self.group is not None:  # every host holds this very file, or none loads it
            from lmspd.engine.group.pipeline import model_digest

            self.group.agree("model file", model_digest(Path(path)))
        model, config = load_model(Path(path), lazy=self.group is not None)
        if self.group is not None:  # only this rank's layers are ever read from the file
            from lmspd.engine.group.pipeline import layer_counts, split

            counts = layer_counts(len(model.layers), [m.memory for m in self.group.members], self.host_layers)
            first, end = split(model, self.group.rank, counts)
            self.prompt_cache.share = (end - first, sum(counts))
        dtype = apply_weight_dtype(model, self.weight_dtype, self.kernel_dir)
        numerics = apply_numerics(model, dtype, self.numerics, self.kernel_dir, weight_file_bytes(Path(path)))
        self.buffer_cache = max(self.buffer_cache, 2 * packed_matrix_bytes(model))
        bound_buffer_cache(self.buffer_cache)
        mx.eval(model.parameters())
        batch = BatchGenerator(
            model,
            completion_batch_size=self.max_concurrency,
            prefill_batch_size=self.max_concurrency,
            prefill_step_size=self.prefill_step_size,
        )
        ctx = context_length_of(config)
        vocab = int(config.get("vocab_size") or model.model.embed_tokens.weight.shape[0])
        fingerprint = model_fingerprint(Path(path))
        pacer = PrefillPacer(self.prefill_step_size, self.prefill_interleave_s)
        lm = LoadedModel(
            name, path, model, Tokenizer(Path(path)), batch, ctx, vocab, dtype, numerics, fingerprint, pacer
        )
        lm.resident_bytes = resident_bytes(model)
        if dtype == "quantized_float32":
            from lmspd.engine import kernels

            lm.kernels = kernels.load(kernels.cache_root(self.kernel_dir))
        if self.group is not None:
            from lmspd.engine.group.pipeline import shares

            lm.hosts = shares(self.group, model, lm.resident_bytes)
        self.models[name] = lm
        self.lifecycle.touch(name)
        self._fit_memory(name)  # its real size may differ from the estimate (auto's choice)
        self.prompt_cache.load(fingerprint)
        # The load's transients (the file's bytes as read, the layers as converted) are freed
        # into glibc's heap, which keeps them: given back, the bundled model holds 18 MB less.
        self.release_due = True
        seconds = time.perf_counter() - start
        self.send(
            p.ModelLoaded(
                model=name,
                weight_dtype=dtype,
                numerics=numerics,
                seconds=seconds,
                resident_bytes=lm.resident_bytes,
                hosts=lm.hosts,
            )
        )
        return lm

    def _evict_for_one(self, path: str = "") -> None:
        """Room for one more model: idle ones go, least recently used first, past
        max_loaded_models or the memory budget (the prompt cache is trimmed before that)."""
        idle = self.idle()
        need = self.budget.estimate(path).total if path else 0
        self._fit_cache(need)
        while idle and (len(self.models) >= self.max_loaded_models or self._held() + need > self.budget.limit):
            name = idle.pop(0)
            self.models.pop(name).batch.close()
            self.release_due = True
            log.info("evicted model %s", name)
            self.send(p.ModelEvicted(name, "budget"))
        self._fit_cache(need)
        import mlx.core as mx

        mx.clear_cache()

    def _held(self) -> int:
        # A split model counts as every host's part (the group's budget; the same on each rank).
        return sum(
            self.budget.held(m.path, sum(h.resident_bytes for h in m.hosts) if m.hosts else m.resident_bytes)
            for m in self.models.values()
        )

    def _fit_cache(self, extra: int = 0) -> None:
        """The prompt cache keeps what the models (and ``extra`` bytes about to load) leave."""
        if self.prompt_cache.enabled:
            self.prompt_cache.fit(self.budget.cache_room(self._held() + extra))

    def _fit_memory(self, loaded: str) -> None:
        idle = [n for n in self.idle() if n != loaded]
        while idle and self._held() > self.budget.limit:
            self.models.pop(idle[0]).batch.close()
            self.release_due = True
            self.send(p.ModelEvicted(idle.pop(0), "budget"))
        self._fit_cache()

    # --- lifecycle (idle unload, operator calls, status) ---------------------------------------

    def idle(self) -> list[str]:
        """Loaded models with nothing running or about to run (a grammar compiling for one)."""
        compiling = self.requests.compiling_for()
        return [n for n, m in self.models.items() if not m.requests and n not in compiling]

    def unload_idle(self) -> None:
        if self.group is not None:
            return
        now = time.monotonic()
        for name, lm in self.models.items():
            if lm.requests:  # in use up to now: its keep-alive counts from its last request
                self.lifecycle.touch(name, now)
        for name in self.lifecycle.due(self.idle(), now):
            self._drop_model(name, "idle")

    def unload_in(self, now: float) -> float | None:
        """Seconds until the next idle unload (None: none is due ever)."""
        return self.lifecycle.wait(self.idle(), now)

    def _drop_model(self, name: str, reason: p.UnloadReason) -> None:
        self.models.pop(name).batch.close()
        self.release_due = True
        log.info("unloaded model %s (%s)", name, reason)
        self._fit_cache()  # the prompt cache may take the room back, up to its own bound
        self.send(p.ModelEvicted(name, reason))

    def release_freed(self) -> None:
        """Give the memory of the models that went, and a load's transients, back to the system
        (release_memory: MLX's buffer cache cleared, glibc's free pages trimmed). The engine's
        loop calls this between commands and steps, where no frame holds a model any more:
        released where a model was dropped, the caller's own reference (``unload``'s ``lm``, a
        loop variable) kept its arrays alive until after the trim, and they were freed into
        MLX's buffer cache and glibc's heap instead, so an unloaded 98 MB model gave back 27 MB
        (docs/memory.md)."""
        if not self.release_due:
            return
        self.release_due = False
        release_memory()
        log.info("freed memory released; engine RSS now %d bytes", rss_bytes())

    def unload(self, name: str, force: bool) -> None:
        lm = self.models.get(name)
        if lm is None:
            return
        if lm.requests and not force:
            log.warning("model %s not unloaded: %d requests running", name, len(lm.requests))
            return
        for req in list(lm.requests.values()):
            lm.batch.remove([req.uid])
            self.requests.finish(lm, req, "cancelled")
        self.requests.send_finished()  # their ends go before the model's
        self._drop_model(name, "operator")

    def status(self, query: int) -> p.EngineStatus:
        now = time.monotonic()
        states: list[p.ModelState] = []
        for name, lm in self.models.items():
            idle, due = self.lifecycle.state(name, len(lm.requests), now)
            states.append(
                p.ModelState(
                    model=name,
                    loaded=True,
                    resident_bytes=lm.resident_bytes,
                    weight_dtype=lm.weight_dtype,
                    numerics=lm.numerics,
                    running=len(lm.requests),
                    idle_secs=idle,
                    unload_in_secs=due,
                    keep_alive_secs=self.lifecycle.keep_alive_of(name),
                    pinned=name in self.lifecycle.pinned,
                    hosts=lm.hosts,
                )
            )
        for name in sorted((self.lifecycle.pinned | set(self.lifecycle.keep_alive)) - set(self.models)):
            states.append(self.lifecycle.unloaded(name))
        import mlx.core as mx

        return p.EngineStatus(
            query=query,
            rss_bytes=rss_bytes(),
            models=states,
            prompt_cache_bytes=self.prompt_cache.nbytes,
            mlx_active_bytes=mx.get_active_memory(),
            mlx_cache_bytes=mx.get_cache_memory(),
        )

    def refusal(self, name: str, path: str) -> LmspdError | None:
        """The error for a model that is not loaded and cannot fit even alone (None: it can)."""
        return None if name in self.models else self.budget.refusal(name, path)

    def evict_failed(self, lm: LoadedModel) -> None:
        """A model whose batch failed goes (its requests have failed already)."""
        if self.models.pop(lm.name, None) is not None:
            self.send(p.ModelEvicted(lm.name, "failed"))
        lm.batch.close()
        self.release_due = True

    def can_load(self, name: str, path: str) -> bool:
        """Loaded, or loadable once idle models are evicted (busy ones are waited for)."""
        if name in self.models:
            return True
        idle = set(self.idle())
        busy = sum(self.budget.held(m.path, m.resident_bytes) for n, m in self.models.items() if n not in idle)
        room = len(self.models) < self.max_loaded_models or bool(idle)
        return room and busy + self.budget.estimate(path).total <= self.budget.limit
