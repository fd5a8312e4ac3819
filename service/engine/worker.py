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

import contextlib
import logging
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # MLX, imported once the BLAS is chosen (main)
    from lmspd.engine.group.ring import Group

log = logging.getLogger("lmspd.engine")


class Engine:
    """The loop: commands from the pipe, each to the part it is for, then one step of every
    batch, and the replies back down the pipe (``send``, which every part is handed)."""

    def __init__(
        self,
        conn: Connection | None,
        config: EngineConfig,
        cache_dir: Path | None = None,
        blas: str = "",
        group: Group | None = None,
        models_dir: Path | None = None,
        *,
        alone: str = "",
    ) -> None:
        from lmspd.engine.prompt_cache import PromptCache

        self.conn = conn  # None: a group's rank past 0, which answers nobody
        self.group = group
        self.alone = alone  # configured for a group, serving alone: why (group_continue_alone)
        # A joined host's own model directory: rank 0's paths name a model there by its
        # directory's name (None: at rank 0's path).
        self.models_dir = models_dir
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
        self.residency.group = group
        self.stepper.fatal = group is not None
        self._loading = False  # the last loop loaded a model: the next tick may wait for the others'

    def send(self, reply: p.Reply) -> None:
        if self.conn is not None:
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
                hosts=self._hosts(),
                alone=self.alone,
            )
        )
        while self.running:
            try:
                compiled = self._tick() if self.group is not None else self._take_commands()
            except EOFError:
                log.warning("the server went away; engine exiting")
                break
            self.admission.admit_compiled(compiled)
            self.residency.unload_idle()
            self.residency.release_freed()
            self.residency.retry_loads()
            self.admission.admit_waiting()
            self.requests.send_early()
            with self._watched("a step"):
                deltas = self.stepper.step()
            if deltas:
                self.send(p.Deltas(deltas))
            self.requests.send_finished()  # after the step's deltas, which carry their last tokens
            try:
                self.prompt_cache.flush(idle=not self.requests.by_id and not self.requests.waiting)
            except Exception:  # the disk copy only saves time later: never the engine's end
                log.exception("prompt cache: entries not written to disk")
        self.prompt_cache.close()  # the write in progress completes: its files are whole
        self.admission.close()

    def _take_commands(self) -> list[str] | None:
        """One process: each command as it comes, until none is waiting (or, idle, until one
        comes); every grammar compiled by now joins (None)."""
        assert self.conn is not None
        timeout = self._timeout()
        while self.running and self.conn.poll(timeout):
            self._handle_safely(self.conn.recv_bytes())
            timeout = 0
        return None

    def _tick(self) -> list[str]:
        """A group: rank 0 takes the commands waiting (or, idle, waits a heartbeat for one) and
        every rank handles the same ones, in the same order; the grammars compiled by rank 0's
        count join on every rank (engine/group)."""
        from lmspd.engine.group.ring import HEARTBEAT_SECS, Tick

        group = self.group
        assert group is not None
        tick: Tick | None = None
        if self.conn is not None:
            timeout = self._timeout()
            timeout = HEARTBEAT_SECS if timeout is None else min(timeout, HEARTBEAT_SECS)
            commands: list[bytes] = []
            while self.conn.poll(timeout):
                commands.append(self.conn.recv_bytes())
                timeout = 0
            # Nothing to do: the others answer this one, so a silent host is found while idle.
            idle = not commands and not self.requests.by_id and not self.requests.waiting
            tick = Tick(group.seq + 1, commands, self.admission.compiled(), ack=idle)
        shared = group.tick(tick, slow=self._loading)
        self._loading = False
        for data in shared.commands:
            if self.running:
                self._handle_safely(data)
        return shared.compiled

    def _watched(self, what: str) -> contextlib.AbstractContextManager[None]:
        if self.group is None:
            return contextlib.nullcontext()
        return self.group.watching(what)

    def _hosts(self) -> list[p.GroupHost]:
        group = self.group
        if group is None:
            return []
        link = group.link_bytes_per_sec
        return [
            p.GroupHost(rank=r, host=m.host, memory_bytes=m.memory, link_bytes_per_sec=link)
            for r, m in enumerate(group.members)
        ]

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
        if isinstance(cmd, p.LoadModel):
            self._loading = True
        if self.models_dir is not None and isinstance(cmd, p.Generate | p.LoadModel):
            cmd = msgspec.structs.replace(cmd, path=str(self.models_dir / Path(cmd.path).name))
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
    step_now(config.speculative_tokens, Drafter, run_ahead=not config.hosts)
    batch_cache.install()  # a merged batch's cache has room for its next position
    prompt_batch.install()  # prefilled prompts move to generation without a copy of their cache
    group, alone = None, ""
    if config.hosts:
        group, config, alone = _lead(conn, config)
    Engine(conn, config, Path(cache_dir) if cache_dir else None, blas, group, alone=alone).run()


def _lead(conn: Connection, config: EngineConfig) -> tuple[Group | None, EngineConfig, str]:
    """Rank 0 of the configured group: formed (every host within group_timeout_secs, the
    same versions), with the settings every rank runs. A group that cannot form ends this
    process, its reason told to the server first (a Failed of no request); or, with
    group_continue_alone, the engine runs the models alone (no group, and why)."""
    from lmspd.engine.group.ring import GROUP_LOST, Group
    from lmspd.errors import EngineGroupError

    def lost(message: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            reply = p.Failed(request_id=None, code="engine_error", message=message, param="engine.hosts")
            conn.send_bytes(p.reply_encoder.encode(reply))

    group = Group(config.hosts, 0, config.group_timeout_secs, lost)
    try:
        config = group.start(config.group_timeout_secs, config)
    except EngineGroupError as exc:
        if config.group_continue_alone:
            log.warning("serving alone (engine.group_continue_alone): %s", exc.message)
            # This host's own settings, its own memory budget among them.
            return None, msgspec.structs.replace(config, hosts=[], host_layers=[]), exc.message
        log.error("%s", exc.message)
        lost(exc.message)
        os._exit(GROUP_LOST)
    log.info(
        "engine group formed: %s",
        ", ".join(f"rank {r} {m.host} ({m.memory >> 20} MiB)" for r, m in enumerate(group.members)),
    )
    return group, config, ""
