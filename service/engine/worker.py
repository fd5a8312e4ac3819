"""The engine process: the only place MLX is imported.

One loop alternates between draining commands from the pipe and running one
step of every loaded model's ``BatchGenerator`` (continuous batching: requests
join and leave between decode steps). Replies go back as msgpack messages; the
token deltas of one step travel together in a single ``Deltas`` message.

``Engine`` composes the parts, each handed what it uses: ``Requests`` (requests.py: every
request taken and how it ends), ``Residency`` (residency.py: the models and the memory
budget), ``Admission`` (admission.py: a ``Generate`` into its model's batch) and ``Stepper``
(stepper.py: one step of each batch), all answering through ``Engine.send``.
"""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.admission import Admission
from lmspd.engine.loaded import COMPILE_POLL_SECS, bound_buffer_cache
from lmspd.engine.requests import Requests
from lmspd.engine.residency import Residency
from lmspd.engine.stepper import Stepper
from lmspd.logs import LogFormat
from lmspd.logs import setup as setup_logging

log = logging.getLogger("lmspd.engine")


class Engine:
    """The loop: commands from the pipe, each to the part it is for, then one step of every
    batch, and the replies back down the pipe (``send``, which every part is handed)."""

    def __init__(self, conn: Connection, config: EngineConfig, cache_dir: Path | None = None, blas: str = "") -> None:
        from lmspd.engine.prompt_cache import PromptCache

        self.conn = conn
        self.blas = blas
        self.prompt_cache = PromptCache(
            config.prompt_cache_max_bytes,
            cache_dir,
            config.prompt_cache_disk_max_bytes,
            config.prompt_cache_disk_min_free_bytes,
        )
        self.requests = Requests(self.send, self.prompt_cache)
        self.residency = Residency(config, self.send, self.prompt_cache, self.requests)
        self.admission = Admission(self.residency, self.requests, self.prompt_cache)
        self.stepper = Stepper(self.residency, self.requests, self.prompt_cache)
        self.running = True

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
            timeout = self._timeout()
            try:
                while self.running and self.conn.poll(timeout):
                    self._handle_safely(self.conn.recv_bytes())
                    timeout = 0
            except EOFError:
                log.warning("the server went away; engine exiting")
                break
            self.admission.admit_compiled()
            self.residency.unload_idle()
            self.residency.release_freed()
            self.residency.retry_loads()
            self.admission.admit_waiting()
            self.requests.send_early()
            if deltas := self.stepper.step():
                self.send(p.Deltas(deltas))
            self.requests.send_finished()  # after the step's deltas, which carry their last tokens
            try:
                self.prompt_cache.flush(idle=not self.requests.by_id and not self.requests.waiting)
            except Exception:  # the disk copy only saves time later: never the engine's end
                log.exception("prompt cache: entries not written to disk")
        self.prompt_cache.close()  # the write in progress completes: its files are whole
        self.admission.close()

    def _timeout(self) -> float | None:
        """How long the loop may wait for a command: not at all while work is running."""
        requests = self.requests
        busy = bool(requests.by_id) or bool(requests.waiting) or bool(self.residency.pending_loads)
        # Idle with entries the disk writer has yet to take: come back for them soon.
        timeout: float | None = 0 if busy else (0.1 if self.prompt_cache.unflushed else None)
        if requests.compiling and not busy:
            timeout = COMPILE_POLL_SECS
        if not busy and (due := self.residency.unload_in(time.monotonic())) is not None:
            timeout = due if timeout is None else min(timeout, due)
        return timeout

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
                self.requests.forget(cmd.request_id)
                self.requests.fail(cmd, "server_error", f"generation could not start: {exc}")
        # Out here, where no frame of the command's holds a model it unloaded or evicted
        # (Residency.release_freed); before the next command, so a Status reports the result.
        self.residency.release_freed()

    def handle(self, cmd: p.Command) -> None:
        if isinstance(cmd, p.Generate):
            self.admission.submit(cmd)
        elif isinstance(cmd, p.Cancel):
            self.requests.cancel(cmd.request_id)
        elif isinstance(cmd, p.LoadModel):
            self.residency.load_command(cmd)
        elif isinstance(cmd, p.Shutdown):
            self.running = False
        elif isinstance(cmd, p.UnloadModel):
            self.residency.unload(cmd.model, cmd.force)
        elif isinstance(cmd, p.PinModel):
            self.residency.pin(cmd)
        elif isinstance(cmd, p.Status):
            self.send(self.residency.status(cmd.query))


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
    from lmspd.engine.speculation import Drafter
    from lmspd.engine.upstream import batch_cache, prompt_batch
    from lmspd.engine.upstream.stepping import install as step_now

    # Each token out as soon as its pass is done, a lone greedy request's drafts verified
    # (upstream/stepping.py).
    step_now(config.speculative_tokens, Drafter)
    batch_cache.install()  # a merged batch's cache has room for its next position
    prompt_batch.install()  # prefilled prompts move to generation without a copy of their cache
    Engine(conn, config, Path(cache_dir) if cache_dir else None, blas).run()
