"""The engine process: the only place MLX is imported.

One loop alternates between draining commands from the pipe and running one
step of every loaded model's ``BatchGenerator`` (continuous batching: requests
join and leave between decode steps). Replies go back as msgpack messages; the
token deltas of one step travel together in a single ``Deltas`` message.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.constraint import GrammarError, GrammarMask, Grammars
from lmspd.engine.lifecycle import Lifecycle, MemoryBudget, release_memory, resident_bytes, rss_bytes
from lmspd.engine.logprobs import TokenPieces, top_logprobs
from lmspd.engine.pacing import PrefillPacer
from lmspd.engine.sampling import SeededSampler
from lmspd.errors import LmspdError
from lmspd.logs import LogFormat
from lmspd.logs import setup as setup_logging
from lmspd.models.registry import context_length_of
from lmspd.models.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("lmspd.engine")

# A prompt whose prefill computed at least this many tokens is cached when its prefill ends
# (shorter ones only with their answer): long enough to be worth a copy of its KV.
KEEP_PREFILL_TOKENS = 256
# ...unless its answer can be at most this many tokens: it is cached when it ends, a few steps
# later, and an early copy would only hold its KV twice meanwhile.
KEEP_SOON_TOKENS = 16
# MLX's buffer cache on the CPU backend, at most (more where a packed model's layers need it).
BUFFER_CACHE_BYTES = 16 << 20
# How often an otherwise idle loop looks for a grammar that has compiled.
COMPILE_POLL_SECS = 0.005


def bound_buffer_cache(nbytes: int = BUFFER_CACHE_BYTES) -> None:
    """On the CPU backend, MLX's buffer cache is bounded: unbounded, it held tens of MB of a
    long prompt's transients; without it, every buffer a prefill allocates layer after layer
    (a packed model dequantizes each matrix) is fresh memory to fault in, and a 38-token
    prompt took 475 ms instead of 300. A few MB of freed buffers, reused, are enough.
    On Metal, where the cache is how buffers are reused, it stays as MLX sets it."""
    import mlx.core as mx

    if not mx.metal.is_available():
        mx.set_cache_limit(nbytes)


@dataclass
class Request:
    cmd: p.Generate
    uid: int
    detok: IncrementalDetokenizer
    completion_tokens: int
    cached_tokens: int = 0  # leading prompt tokens whose KV came from the prompt cache
    decoding: bool = False  # prefill done: it now waits on every prefill step
    held: str = ""  # text withheld because it may be the start of a stop string
    mask: GrammarMask | None = None  # its grammar, when constrained


def keeps_early(req: Request) -> bool:
    """Whether a request's prompt is cached as soon as it is prefilled (not only at its end)."""
    computed = len(req.cmd.prompt) + len(req.cmd.generated) - req.cached_tokens
    return computed >= KEEP_PREFILL_TOKENS and req.cmd.max_tokens - len(req.cmd.generated) > KEEP_SOON_TOKENS


@dataclass
class LoadedModel:
    name: str
    path: str
    model: Any
    tokenizer: Tokenizer
    batch: Any  # mlx_lm BatchGenerator
    context_length: int
    vocab_size: int
    weight_dtype: str
    fingerprint: str  # the prompt cache's namespace for these weights
    pacer: PrefillPacer
    resident_bytes: int = 0
    requests: dict[int, Request] = field(default_factory=dict)
    pieces: TokenPieces | None = None  # built on the first request that asks for logprobs
    grammars: Grammars | None = None  # built on the first constrained request

    def token_pieces(self) -> TokenPieces:
        if self.pieces is None:
            self.pieces = TokenPieces(Path(self.path))
        return self.pieces

    def grammar_set(self) -> Grammars:
        if self.grammars is None:
            self.grammars = Grammars(Path(self.path), self.tokenizer.eos_token_ids, self.vocab_size)
        return self.grammars

    def grammar_mask(self, grammar: str, generated: list[int]) -> GrammarMask:
        return self.grammar_set().mask(grammar, generated)


class Engine:
    def __init__(self, conn: Connection, config: EngineConfig, cache_dir: Path | None = None, blas: str = "") -> None:
        from lmspd.engine.prompt_cache import PromptCache

        self.conn = conn
        self.blas = blas
        self.max_concurrency = config.max_concurrency
        self.max_loaded_models = config.max_loaded_models
        self.weight_dtype = config.weight_dtype
        self.kernel_dir = config.kernel_dir
        self.buffer_cache = BUFFER_CACHE_BYTES
        self.prefill_step_size = config.prefill_step_size
        self.prefill_interleave_s = config.prefill_interleave_ms / 1000
        self.prompt_cache = PromptCache(
            config.prompt_cache_max_bytes,
            cache_dir,
            config.prompt_cache_disk_max_bytes,
            config.prompt_cache_disk_min_free_bytes,
        )
        self.models: OrderedDict[str, LoadedModel] = OrderedDict()  # least recently used first
        self.waiting: deque[p.Generate] = deque()  # requests for a model that cannot load yet
        self.pending_loads: deque[p.LoadModel] = deque()  # loads waiting for a busy model's room
        # Requests whose grammar compiles in the grammar thread (a large one takes a while:
        # the batch decodes on meanwhile), by request id.
        self.compiling: dict[str, tuple[p.Generate, Future[Any]]] = {}
        self._compiler: ThreadPoolExecutor | None = None
        self.by_id: dict[str, tuple[LoadedModel, Request]] = {}
        self.running = True
        self.finished: list[p.Finished] = []
        self.lifecycle = Lifecycle(config.keep_alive_secs)
        self.budget = MemoryBudget(config)

    def send(self, reply: p.Reply) -> None:
        self.conn.send_bytes(p.reply_encoder.encode(reply))

    # --- loop -------------------------------------------------------------------------------

    def run(self) -> None:
        import mlx.core as mx

        bound_buffer_cache()
        self.send(
            p.Ready(
                pid=os.getpid(),
                backend="gpu" if mx.metal.is_available() else "cpu",
                mlx_version=getattr(mx, "__version__", "unknown"),
                blas=self.blas,
            )
        )
        while self.running:
            busy = bool(self.by_id) or bool(self.waiting) or bool(self.pending_loads)
            # Idle with entries the disk writer has yet to take: come back for them soon.
            timeout: float | None = 0 if busy else (0.1 if self.prompt_cache.unflushed else None)
            if self.compiling and not busy:
                timeout = COMPILE_POLL_SECS
            if not busy and (due := self.lifecycle.wait(self._idle(), time.monotonic())) is not None:
                timeout = due if timeout is None else min(timeout, due)
            try:
                while self.running and self.conn.poll(timeout):
                    self._handle_safely(self.conn.recv_bytes())
                    timeout = 0
            except EOFError:
                log.warning("the server went away; engine exiting")
                break
            self._admit_compiled()
            self._unload_idle()
            self._admit_waiting()
            deltas: list[p.Delta] = []
            for lm in list(self.models.values()):
                if lm.requests:
                    self._step(lm, deltas)
            if deltas:
                self.send(p.Deltas(deltas))
            # Finished replies go after the step's deltas, which carry their last tokens.
            for reply in self.finished:
                self.send(reply)
            self.finished.clear()
            try:
                self.prompt_cache.flush(idle=not self.by_id and not self.waiting)
            except Exception:  # the disk copy only saves time later: never the engine's end
                log.exception("prompt cache: entries not written to disk")
        self.prompt_cache.close()  # the write in progress completes: its files are whole
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    def _handle_safely(self, data: bytes) -> None:
        """One bad command fails alone; it never takes the engine down."""
        try:
            cmd = p.command_decoder.decode(data)
        except msgspec.DecodeError:
            log.exception("undecodable command dropped")
            return
        try:
            self.handle(cmd)
        except Exception as exc:
            log.exception("command %s failed", type(cmd).__name__)
            if isinstance(cmd, p.Generate):
                self.by_id.pop(cmd.request_id, None)
                self._fail(cmd, "server_error", f"generation could not start: {exc}")

    def handle(self, cmd: p.Command) -> None:
        if isinstance(cmd, p.Generate):
            self._submit(cmd)
        elif isinstance(cmd, p.Cancel):
            self._cancel(cmd.request_id)
        elif isinstance(cmd, p.LoadModel):
            if cmd.keep_alive_secs is not None:
                self.lifecycle.keep_alive[cmd.model] = cmd.keep_alive_secs
            if self.budget.fits_alone(cmd.path) and not self._can_load(cmd.model, cmd.path):
                self.pending_loads.append(cmd)  # busy models hold the memory: loaded once they are done
                return
            was_loaded = cmd.model in self.models
            lm = self._load_or_fail(cmd.model, cmd.path)
            if lm is not None and was_loaded:  # a caller is waiting for this answer
                self.lifecycle.touch(lm.name)  # loaded for a request on its way: not idle now
                self.send(
                    p.ModelLoaded(
                        model=cmd.model, weight_dtype=lm.weight_dtype, seconds=0.0, resident_bytes=lm.resident_bytes
                    )
                )
        elif isinstance(cmd, p.Shutdown):
            self.running = False
        elif isinstance(cmd, p.UnloadModel):
            self._unload(cmd.model, cmd.force)
        elif isinstance(cmd, p.PinModel):
            (self.lifecycle.pinned.add if cmd.pinned else self.lifecycle.pinned.discard)(cmd.model)
        elif isinstance(cmd, p.Status):
            self.send(self._status(cmd.query))

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
            room = self.budget.cache_room(self._held() + extra)
            self.prompt_cache.lru.max_bytes = room
            self.prompt_cache.lru.trim_to(n_bytes=room)

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

    def _admit_waiting(self) -> None:
        for _ in range(len(self.pending_loads)):
            load = self.pending_loads.popleft()
            if self._can_load(load.model, load.path):
                self.handle(load)
            else:
                self.pending_loads.append(load)
        for _ in range(len(self.waiting)):
            cmd = self.waiting.popleft()
            if self._can_load(cmd.model, cmd.path):
                self._submit(cmd)
            else:
                self.waiting.append(cmd)

    # --- requests ---------------------------------------------------------------------------

    def _fail(self, cmd: p.Generate, code: str, message: str, param: str | None = None) -> None:
        self.send(p.Failed(request_id=cmd.request_id, code=code, message=message, param=param, model=cmd.model))

    def _admit_compiled(self) -> None:
        """Requests whose grammar has compiled join the batch (or fail, if it did not compile)."""
        for request_id, (cmd, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                template = future.result()
            except GrammarError as exc:
                self._fail(cmd, "invalid_request", f"the output grammar cannot be used: {exc}", "text.format")
                continue
            except Exception as exc:
                log.exception("compiling a grammar failed")
                self._fail(cmd, "server_error", f"the output grammar could not be compiled: {exc}")
                continue
            if (lm := self.models.get(cmd.model)) is not None and cmd.grammar is not None:
                lm.grammar_set().keep(cmd.grammar, template)
            self._submit(cmd)

    def _submit(self, cmd: p.Generate) -> None:
        if cmd.request_id in self.by_id or cmd.request_id in self.compiling:
            return self._fail(cmd, "invalid_request", f"request id {cmd.request_id} is already running")
        if cmd.model not in self.models and (refused := self.budget.refusal(cmd.model, cmd.path)) is not None:
            return self._fail(cmd, refused.code, refused.message, "model")  # it would wait forever
        if not self._can_load(cmd.model, cmd.path):
            self.waiting.append(cmd)
            return None
        lm = self._load_or_fail(cmd.model, cmd.path)
        if lm is None:
            # The model exists (it was resolved) but did not load: not a 404.
            return self._fail(cmd, "model_load_failed", f"model '{cmd.model}' could not be loaded", "model")
        try:
            cmd.sampling.validate()
            p.validate_top_logprobs(cmd.logprobs)
        except LmspdError as exc:
            return self._fail(cmd, exc.code, exc.message, exc.param)
        tokens = cmd.prompt + cmd.generated
        if not cmd.prompt:
            return self._fail(cmd, "invalid_request", "the prompt is empty", "input")
        if any(not 0 <= t < lm.vocab_size for t in tokens):
            # MLX does not bounds-check embedding lookups: an out-of-range id reads garbage.
            return self._fail(cmd, "invalid_request", f"token ids must be in [0, {lm.vocab_size})", "input")
        if cmd.max_tokens < 1:
            return self._fail(
                cmd, "invalid_request", f"max_tokens must be >= 1, got {cmd.max_tokens}", "max_output_tokens"
            )
        if len(tokens) >= lm.context_length:
            return self._fail(
                cmd,
                "context_length_exceeded",
                f"{len(tokens)} tokens exceed the model's context of {lm.context_length}",
                "input",
            )
        remaining = min(cmd.max_tokens - len(cmd.generated), lm.context_length - len(tokens))
        if remaining <= 0:
            self.send(
                p.Finished(
                    request_id=cmd.request_id,
                    reason="length",
                    prompt_tokens=len(cmd.prompt),
                    completion_tokens=len(cmd.generated),
                )
            )
            return None
        if cmd.grammar and not lm.grammar_set().compiled(cmd.grammar):
            if self._compiler is None:
                self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            self.compiling[cmd.request_id] = (cmd, self._compiler.submit(lm.grammar_set().compile, cmd.grammar))
            return None
        try:
            processors = [lm.grammar_mask(cmd.grammar, cmd.generated)] if cmd.grammar else []
        except GrammarError as exc:
            return self._fail(cmd, "invalid_request", f"the output grammar cannot be used: {exc}", "text.format")
        self._insert(lm, cmd, tokens, remaining, processors)
        return None

    def _insert(
        self, lm: LoadedModel, cmd: p.Generate, tokens: list[int], remaining: int, processors: list[GrammarMask]
    ) -> None:
        from mlx_lm.generate import StopSequences
        from mlx_lm.sample_utils import make_sampler

        s = cmd.sampling
        sampler: Any
        if s.seed is not None and s.temperature > 0:
            sampler = SeededSampler(s, s.seed, already=len(cmd.generated))
        else:  # greedy ignores a seed; unseeded sampling draws from MLX's global generator
            sampler = make_sampler(
                temp=s.temperature, top_p=s.top_p if s.top_p < 1.0 else 0.0, top_k=s.top_k, min_p=s.min_p
            )
        stops = StopSequences([[t] for t in cmd.stop_token_ids] or None)
        hit = self.prompt_cache.fetch((lm.fingerprint, cmd.cache_key), tokens)
        (uid,) = lm.batch.insert(
            [tokens[hit.cached :]],
            max_tokens=[remaining],
            caches=[hit.cache] if hit.cache is not None else None,
            # What the cache already holds: the batch reports it back with the finished cache.
            all_tokens=[tokens[: hit.cached]],
            samplers=[sampler],
            logits_processors=[list(processors)],
            stop_sequences=[stops],
        )
        req = Request(cmd, uid, IncrementalDetokenizer(lm.tokenizer, cmd.generated), len(cmd.generated))
        req.mask = processors[0] if processors else None
        # A resumed request's cached tokens are counted against its prompt only.
        req.cached_tokens = min(hit.cached, len(cmd.prompt))
        lm.requests[uid] = req
        self.by_id[cmd.request_id] = (lm, req)

    def _cancel(self, request_id: str) -> None:
        # Not in the batch yet: waiting for its model, or for its grammar to compile.
        compiling = self.compiling.pop(request_id, None)
        pending = compiling[0] if compiling is not None else None
        for i, cmd in enumerate(self.waiting):
            if cmd.request_id == request_id:
                del self.waiting[i]
                pending = cmd
                break
        if pending is not None:
            self.send(
                p.Finished(
                    request_id=request_id,
                    reason="cancelled",
                    prompt_tokens=len(pending.prompt),
                    completion_tokens=len(pending.generated),
                )
            )
            return
        found = self.by_id.get(request_id)
        if found is None:
            return  # already finished: its Finished reply is on its way
        lm, req = found
        self._remove(lm, req)
        self._finish(lm, req, "cancelled")

    def _finish(self, lm: LoadedModel, req: Request, reason: p.FinishReason, text: str = "") -> None:
        del lm.requests[req.uid]
        del self.by_id[req.cmd.request_id]
        self.finished.append(
            p.Finished(
                request_id=req.cmd.request_id,
                reason=reason,
                prompt_tokens=len(req.cmd.prompt),
                completion_tokens=req.completion_tokens,
                cached_tokens=req.cached_tokens,
                text=text,
            )
        )

    def _step(self, lm: LoadedModel, deltas: list[p.Delta]) -> None:
        lm.batch.prefill_step_size = lm.pacer.step_size(any(r.decoding for r in lm.requests.values()))
        try:
            with lm.batch.stats() as stats:
                prefilled, responses = lm.batch.next()
        except Exception as exc:  # an MLX failure poisons the whole batch
            log.exception("decode step failed")
            self._fail_all(lm, f"generation failed: {exc}")
            return
        lm.pacer.observe(stats.prompt_tokens, stats.prompt_time)
        for r in prefilled:
            if r.end_of_prompt and (req := lm.requests.get(r.uid)) is not None:
                req.decoding = True
        self._keep_prompts(lm, prefilled)
        live = [(r, req) for r in responses if (req := lm.requests.get(r.uid)) is not None]
        try:
            scored = self._score(lm, live)
        except Exception as exc:  # only the requests that asked for logprobs depend on them
            log.exception("logprobs failed")
            for _, req in live:
                if req.cmd.logprobs is not None:
                    self._drop(lm, req, f"logprobs failed: {exc}")
            live = [(r, req) for r, req in live if req.cmd.logprobs is None]
            scored = {}
        for r, req in live:
            if req.mask is not None and req.mask.failure is not None:
                self._drop(
                    lm,
                    req,
                    f"the output grammar cannot go on: {req.mask.failure}",
                    code="invalid_request",
                    in_batch=r.finish_reason is None,
                )
                continue
            if r.finish_reason is not None and r.prompt_cache is not None:
                self.prompt_cache.store((lm.fingerprint, req.cmd.cache_key), r.all_tokens, r.prompt_cache)
            self._on_token(lm, req, r.token, r.finish_reason, deltas, scored.get(r.uid))

    @staticmethod
    def _score(lm: LoadedModel, live: list[tuple[Any, Request]]) -> dict[int, p.TokenLogprob]:
        """Logprobs for the tokens of requests that asked; others pay nothing."""
        # A stop token is not output, so it gets no entry either.
        wanted = [
            (r, req.cmd.logprobs) for r, req in live if req.cmd.logprobs is not None and r.finish_reason != "stop"
        ]
        if not wanted:
            return {}
        chosen, tops = top_logprobs(
            [r.logprobs for r, _ in wanted], [r.token for r, _ in wanted], [k for _, k in wanted]
        )
        pieces = lm.token_pieces()
        scored: dict[int, p.TokenLogprob] = {}
        for (r, _), logprob, top in zip(wanted, chosen, tops, strict=True):
            alternatives = [p.TopLogprob(*pieces.scored(t, v)) for t, v in top]
            scored[r.uid] = p.TokenLogprob(*pieces.scored(r.token, logprob), alternatives)
        return scored

    def _on_token(
        self,
        lm: LoadedModel,
        req: Request,
        token: int,
        finish: str | None,
        deltas: list[p.Delta],
        logprob: p.TokenLogprob | None = None,
    ) -> None:
        ids: list[int] = []
        text = ""
        if finish != "stop":  # a stop token ends the output without being part of it
            req.completion_tokens += 1
            ids = [token]
            text = req.detok.add(token)
        if finish is not None:
            text += req.detok.flush()
        text, hit = self._apply_stop_strings(req, text)
        if ids or text:
            logprobs = None if req.cmd.logprobs is None else ([logprob] if ids and logprob else [])
            deltas.append(p.Delta(req.cmd.request_id, ids, text, logprobs))
        if hit:
            if finish is None:
                self._remove(lm, req)
            self._finish(lm, req, "stop")
        elif finish is not None:
            # No stop string matched after all: the held-back text is output.
            self._finish(lm, req, "stop" if finish == "stop" else "length", req.held)

    @staticmethod
    def _apply_stop_strings(req: Request, text: str) -> tuple[str, bool]:
        """Cut text at the first stop string; hold back a suffix that may start one."""
        stops = req.cmd.stop
        if not stops:
            return text, False
        pending = req.held + text
        cut = min((i for i in (pending.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            req.held = ""
            return pending[:cut], True
        keep = max((k for s in stops for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
        req.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def _keep_prompts(self, lm: LoadedModel, prefilled: list[Any]) -> None:
        """Cache a long prompt as soon as it is prefilled, not only when its answer ends: a
        request sharing it meanwhile, or this one resumed after a crash, skips that work."""
        if not self.prompt_cache.enabled:
            return
        done = [
            r.uid
            for r in prefilled
            if r.end_of_prompt and (req := lm.requests.get(r.uid)) is not None and keeps_early(req)
        ]
        for uid, (cache, tokens) in lm.batch.extract_cache(done).items():
            self.prompt_cache.store((lm.fingerprint, lm.requests[uid].cmd.cache_key), tokens, cache)

    def _remove(self, lm: LoadedModel, req: Request) -> None:
        """Take a request out of the batch, keeping what its KV cache holds for later prompts."""
        found = lm.batch.remove([req.uid], return_prompt_caches=self.prompt_cache.enabled)
        if req.uid in found:
            cache, tokens = found[req.uid]
            if tokens and len(tokens) > req.cached_tokens:  # only a cache that learnt something
                self.prompt_cache.store((lm.fingerprint, req.cmd.cache_key), tokens, cache)

    def _drop(
        self, lm: LoadedModel, req: Request, message: str, code: str = "server_error", in_batch: bool = True
    ) -> None:
        if in_batch:
            lm.batch.remove([req.uid])
        del lm.requests[req.uid]
        del self.by_id[req.cmd.request_id]
        self._fail(req.cmd, code, message)

    def _fail_all(self, lm: LoadedModel, message: str) -> None:
        for req in list(lm.requests.values()):
            del lm.requests[req.uid]
            del self.by_id[req.cmd.request_id]
            self._fail(req.cmd, "server_error", message)
        if self.models.pop(lm.name, None) is not None:
            self.send(p.ModelEvicted(lm.name, "failed"))
        lm.batch.close()


def main(
    conn: Connection,
    config: EngineConfig,
    cache_dir: str | None,
    log_level: int = logging.INFO,
    log_format: LogFormat = "text",
) -> None:
    """Entry point of the spawned engine process."""
    from lmspd.engine.lifeline import bind_to_parent

    bind_to_parent(os.getppid())  # first: a server killed from now on takes its engine with it
    # The server's format, and its level for its own loggers (the root stays at its default
    # for libraries').
    text = "%(asctime)s engine %(levelname)s %(message)s"
    setup_logging(log_format, logging.WARNING, text=text, static={"process": "engine"})
    logging.getLogger("lmspd").setLevel(log_level)
    from lmspd.engine.upstream.blas import load as load_blas

    blas = load_blas(config.blas)  # before anything imports MLX
    from lmspd.engine.upstream.lean import import_mlx_lm

    import_mlx_lm()
    Engine(conn, config, Path(cache_dir) if cache_dir else None, blas).run()
