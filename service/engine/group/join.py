"""``lmspd engine join``: a host's rank in the engine group of the server named first in
``[engine] hosts`` (docs/distributed.md).

The command supervises: each rank runs in a process of its own, which joins the group, takes
rank 0's settings and then runs the engine loop on rank 0's commands (worker.Engine, with no
one to answer). When the group breaks (rank 0's engine restarted, a host lost), that process
exits and a fresh one joins the next group: MLX's ring backend forms once per process.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from pathlib import Path
from types import FrameType

from lmspd.config import EngineConfig
from lmspd.errors import EngineGroupError
from lmspd.logs import LogFormat
from lmspd.logs import setup as setup_logging

log = logging.getLogger("lmspd.engine")

# A rank waits this many group_timeout_secs for rank 0 before it starts over (MLX's
# connection retries back off to long waits; a fresh process tries again at once).
JOIN_WAIT_TIMEOUTS = 2
# Between two ranks, at least this long (a rank that cannot start must not spin).
RESPAWN_SECS = 1.0


def follow(config: EngineConfig, rank: int, models_dir: str | None, log_level: int, log_format: LogFormat) -> None:
    """One rank's process: join, take rank 0's settings, run the engine loop until the group
    ends."""
    import os

    import msgspec

    from lmspd.engine.lifeline import bind_to_parent

    bind_to_parent(os.getppid())  # a join stopped takes its rank with it
    text = f"%(asctime)s rank {rank} %(levelname)s %(message)s"
    setup_logging(log_format, logging.WARNING, text=text, static={"process": f"rank {rank}"})
    logging.getLogger("lmspd").setLevel(log_level)
    from lmspd.engine.upstream.blas import load as load_blas

    blas = load_blas(config.blas)
    from lmspd.engine.upstream.lean import import_mlx_lm

    import_mlx_lm()
    from lmspd.engine.group.ring import GROUP_LOST, Group

    group = Group(config.hosts, rank, config.group_timeout_secs)
    try:
        settings = group.start(JOIN_WAIT_TIMEOUTS * config.group_timeout_secs)
    except EngineGroupError as exc:
        log.error("%s", exc.message)
        raise SystemExit(GROUP_LOST) from exc
    # Rank 0's settings, but this host's own place for the kernels it builds.
    settings = msgspec.structs.replace(settings, kernel_dir=config.kernel_dir)
    log.info("joined the engine group as rank %d of %d (%s)", rank, group.size, config.hosts[0])
    from lmspd.engine.speculation import Drafter
    from lmspd.engine.upstream import batch_cache, prompt_batch
    from lmspd.engine.upstream.stepping import install as step_now
    from lmspd.engine.worker import Engine

    step_now(settings.speculative_tokens, Drafter, run_ahead=False)
    batch_cache.install()
    prompt_batch.install()
    Engine(None, settings, None, blas, group, Path(models_dir) if models_dir else None).run()


def run(config: EngineConfig, rank: int, log_level: int, log_format: LogFormat, models_dir: str | None = None) -> int:
    """Ranks, one after another, until SIGTERM or SIGINT; the exit status. ``models_dir``: where
    this host keeps its models (rank 0's paths name them by directory name; None: the same
    paths as rank 0's)."""
    if len(config.hosts) < 2:
        raise EngineGroupError(
            "engine.hosts names no group: `engine join` needs two or more hosts", param="engine.hosts"
        )
    if not 0 < rank < len(config.hosts):
        raise EngineGroupError(
            f"--rank {rank}: ranks 1..{len(config.hosts) - 1} join ({config.hosts[0]} is rank 0, the server's engine)",
            param="rank",
        )
    stopping = False
    child: mp.process.BaseProcess | None = None

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.is_alive():
            child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        started = time.monotonic()
        child = mp.get_context("spawn").Process(
            target=follow, args=(config, rank, models_dir, log_level, log_format), name=f"lmspd-rank-{rank}"
        )
        child.start()
        log.info("rank %d: waiting for the group of %s (pid %s)", rank, config.hosts[0], child.pid)
        child.join()
        if not stopping:
            log.warning("rank %d left the group (exit code %s); joining again", rank, child.exitcode)
            time.sleep(max(0.0, RESPAWN_SECS - (time.monotonic() - started)))
    return 0
