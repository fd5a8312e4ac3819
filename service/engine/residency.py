"""Which models the engine holds: loading, eviction within the memory budget, idle unload,
an operator's unload, and the status report (docs/operations.md, "Models over a long life").

``Residency`` is the engine's model half; ``worker.Engine`` adds the requests and the loop.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmspd.engine import protocol as p
from lmspd.engine.lifecycle import Lifecycle, MemoryBudget, release_memory, resident_bytes, rss_bytes
from lmspd.engine.loaded import LoadedModel, Request, bound_buffer_cache
from lmspd.engine.pacing import PrefillPacer
from lmspd.errors import LmspdError
from lmspd.models.registry import context_length_of
from lmspd.models.tokenizer import Tokenizer

if TYPE_CHECKING:  # it imports MLX, which the server process never does (engine/worker.py)
    from lmspd.engine.prompt_cache import PromptCache

log = logging.getLogger("lmspd.engine")


class Residency:
    """The loaded models, least recently used first, and what decides when they go."""

    models: OrderedDict[str, LoadedModel]
    waiting: deque[p.Generate]
    compiling: dict[str, tuple[p.Generate, Future[Any]]]
    finished: list[p.Finished]
    lifecycle: Lifecycle
    budget: MemoryBudget
    prompt_cache: PromptCache
    max_concurrency: int
    max_loaded_models: int
    weight_dtype: str
    kernel_dir: str
    buffer_cache: int
    prefill_step_size: int
    prefill_interleave_s: float

    def send(self, reply: p.Reply) -> None:
        raise NotImplementedError

    def _finish(self, lm: LoadedModel, req: Request, reason: p.FinishReason, text: str = "") -> None:
        raise NotImplementedError

    # --- models -----------------------------------------------------------------------------

    def _load_or_fail(self, name: str, path: str) -> LoadedModel | None:
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
        from lmspd.engine.weights import apply_weight_dtype

        if (refused := self.budget.refusal(name, path)) is not None:
            raise refused
        self._evict_for_one(path)
        self.send(p.ModelLoading(name))
        start = time.perf_counter()
        model, config = load_model(Path(path))
        dtype = apply_weight_dtype(model, self.weight_dtype, self.kernel_dir)
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
        lm = LoadedModel(name, path, model, Tokenizer(Path(path)), batch, ctx, vocab, dtype, fingerprint, pacer)
        lm.resident_bytes = resident_bytes(model)
        self.models[name] = lm
        self.lifecycle.touch(name)
        self._fit_memory(name)  # its real size may differ from the estimate (auto's choice)
        self.prompt_cache.load(fingerprint)
        seconds = time.perf_counter() - start
        self.send(p.ModelLoaded(model=name, weight_dtype=dtype, seconds=seconds, resident_bytes=lm.resident_bytes))
        return lm

    def _evict_for_one(self, path: str = "") -> None:
        """Room for one more model: idle ones go, least recently used first, past
        max_loaded_models or the memory budget (the prompt cache is trimmed before that)."""
        idle = self._idle()
        need = self.budget.estimate(path).total if path else 0
        self._fit_cache(need)
        while idle and (len(self.models) >= self.max_loaded_models or self._held() + need > self.budget.limit):
            lm = self.models.pop(idle.pop(0))
            lm.batch.close()
            log.info("evicted model %s", lm.name)
            self.send(p.ModelEvicted(lm.name, "budget"))
        self._fit_cache(need)
        import mlx.core as mx

        mx.clear_cache()

    def _held(self) -> int:
        return sum(self.budget.held(m.path, m.resident_bytes) for m in self.models.values())

    def _fit_cache(self, extra: int = 0) -> None:
        """The prompt cache keeps what the models (and ``extra`` bytes about to load) leave."""
        if self.prompt_cache.enabled:
            self.prompt_cache.fit(self.budget.cache_room(self._held() + extra))

    def _fit_memory(self, loaded: str) -> None:
        idle = [n for n in self._idle() if n != loaded]
        while idle and self._held() > self.budget.limit:
            self.models.pop(idle[0]).batch.close()
            self.send(p.ModelEvicted(idle.pop(0), "budget"))
        self._fit_cache()

    # --- lifecycle (idle unload, operator calls, status) ---------------------------------------

    def _idle(self) -> list[str]:
        """Loaded models with nothing running or about to run (a grammar compiling for one)."""
        compiling = {cmd.model for cmd, _ in self.compiling.values()}
        return [n for n, m in self.models.items() if not m.requests and n not in compiling]

    def _unload_idle(self) -> None:
        now = time.monotonic()
        for name, lm in self.models.items():
            if lm.requests:  # in use up to now: its keep-alive counts from its last request
                self.lifecycle.touch(name, now)
        for name in self.lifecycle.due(self._idle(), now):
            self._drop_model(name, "idle")

    def _drop_model(self, name: str, reason: p.UnloadReason) -> None:
        lm = self.models.pop(name)
        lm.batch.close()
        del lm
        release_memory()
        log.info("unloaded model %s (%s); engine RSS now %d bytes", name, reason, rss_bytes())
        self._fit_cache()  # the prompt cache may take the room back, up to its own bound
        self.send(p.ModelEvicted(name, reason))

    def _unload(self, name: str, force: bool) -> None:
        lm = self.models.get(name)
        if lm is None:
            return
        if lm.requests and not force:
            log.warning("model %s not unloaded: %d requests running", name, len(lm.requests))
            return
        for req in list(lm.requests.values()):
            lm.batch.remove([req.uid])
            self._finish(lm, req, "cancelled")
        for reply in self.finished:  # their ends go before the model's
            self.send(reply)
        self.finished.clear()
        self._drop_model(name, "operator")

    def _status(self, query: int) -> p.EngineStatus:
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
                    running=len(lm.requests),
                    idle_secs=idle,
                    unload_in_secs=due,
                    keep_alive_secs=self.lifecycle.keep_alive_of(name),
                    pinned=name in self.lifecycle.pinned,
                )
            )
        for name in sorted((self.lifecycle.pinned | set(self.lifecycle.keep_alive)) - set(self.models)):
            states.append(self.lifecycle.unloaded(name))
        return p.EngineStatus(
            query=query, rss_bytes=rss_bytes(), models=states, prompt_cache_bytes=self.prompt_cache.nbytes
        )

    def _can_load(self, name: str, path: str) -> bool:
        """Loaded, or loadable once idle models are evicted (busy ones are waited for)."""
        if name in self.models:
            return True
        idle = set(self._idle())
        busy = sum(self.budget.held(m.path, m.resident_bytes) for n, m in self.models.items() if n not in idle)
        room = len(self.models) < self.max_loaded_models or bool(idle)
        return room and busy + self.budget.estimate(path).total <= self.budget.limit
