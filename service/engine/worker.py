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
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.admission import Admission
from lmspd.engine.lifecycle import Lifecycle, MemoryBudget
from lmspd.engine.loaded import (
    BUFFER_CACHE_BYTES,
    COMPILE_POLL_SECS,
    LoadedModel,
    Request,
    bound_buffer_cache,
    keeps_early,
)
from lmspd.logs import LogFormat
from lmspd.logs import setup as setup_logging

log = logging.getLogger("lmspd.engine")


class Engine(Admission):
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
        # First tokens that needed no pass (a kept prompt end): sent before the next step runs.
        self.early: list[p.Delta] = []
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
            if self.early:
                self.send(p.Deltas(self.early))
                self.early = []
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

    def _finish(
        self, lm: LoadedModel, req: Request, reason: p.FinishReason, text: str = "", stop_sequence: str | None = None
    ) -> None:
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
                stop_sequence=stop_sequence,
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
        self._keep_ends(lm, live)
        try:
            # Only the requests that asked pay; a stop token is not output, so it gets no entry.
            scored = lm.score(
                [
                    (r.uid, r.token, r.logprobs, req.cmd.logprobs)
                    for r, req in live
                    if req.cmd.logprobs is not None and r.finish_reason != "stop"
                ],
            )
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
        if hit is not None:
            if finish is None:
                self._remove(lm, req)
            self._finish(lm, req, "stop", stop_sequence=hit)
        elif finish is not None:
            # No stop string matched after all: the held-back text is output.
            self._finish(lm, req, "stop" if finish == "stop" else "length", req.held)

    @staticmethod
    def _apply_stop_strings(req: Request, text: str) -> tuple[str, str | None]:
        """Cut text at the first stop string (returned: the one that matched, else None);
        hold back a suffix that may start one."""
        stops = req.cmd.stop
        if not stops:
            return text, None
        pending = req.held + text
        found = [(i, s) for s in stops if (i := pending.find(s)) >= 0]
        if found:
            cut, hit = min(found, key=lambda f: f[0])
            req.held = ""
            return pending[:cut], hit
        keep = max((k for s in stops for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
        req.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], None

    def _keep_ends(self, lm: LoadedModel, live: list[tuple[Any, Request]]) -> None:
        """The logprobs of each request's first pass, which ended its prompt: an exact repeat
        then takes its first token from them (prompt_ends.py)."""
        for r, req in live:
            if req.keep_end is not None:
                self.prompt_cache.ends.keep((lm.fingerprint, req.cmd.cache_key), req.keep_end, r.logprobs)
                req.keep_end = None

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
    from lmspd.engine.upstream import batch_cache, prompt_batch
    from lmspd.engine.upstream.stepping import install as step_now

    step_now()  # each token out as soon as its pass is done (upstream/stepping.py)
    batch_cache.install()  # a merged batch's cache has room for its next position
    prompt_batch.install()  # prefilled prompts move to generation without a copy of their cache
    Engine(conn, config, Path(cache_dir) if cache_dir else None, blas).run()
