"""The server's state in one read, for the console's server page (``GET /lmsp/v1/summary``,
docs/console.md): the owner's tasks by status, the models, the engine and the recent speed.

Counts are the owner's own (a token never learns the size of another's queue); the models, the
engine and the speed are the server's, as ``/lmsp/v1/models`` and ``/metrics`` already show any
token."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Literal

from lmspd.core.lifecycle import ModelView
from lmspd.core.supervisor import Supervisor
from lmspd.errors import LmspdError
from lmspd.metrics import Metrics
from lmspd.store.task_store import TaskStore

EngineState = Literal["up", "down", "recycling"]


@dataclass(frozen=True)
class ServerState:
    now: int  # unix seconds on the server (the page counts unload times down from it)
    accepting: bool
    tasks: dict[str, int]  # the owner's tasks by status, every status named
    models: list[ModelView]
    engine: EngineState
    engine_pid: int | None
    engine_rss_bytes: int | None  # None when the engine is down
    engine_in_flight: int
    engine_uptime_secs: float
    generations: int  # how many recent generations the speed figures describe
    ttft_secs: float | None  # their median time to first token
    tokens_per_sec: float | None  # their decode speed after the first token


async def server_state(
    owner: str, *, store: TaskStore, supervisor: Supervisor, metrics: Metrics, accepting: bool
) -> ServerState:
    engine = supervisor.engine
    rss: int | None = None
    if engine.alive:
        with contextlib.suppress(LmspdError):  # dying now: reported down on the next read
            rss = (await engine.status()).rss_bytes
    state: EngineState = "recycling" if supervisor.recycler.busy else ("up" if engine.alive else "down")
    stats = engine.stats()
    generations, ttft, speed = metrics.recent.figures()
    return ServerState(
        now=int(time.time()),
        accepting=accepting,
        tasks=await store.owner_status_counts(owner),
        models=await supervisor.lifecycle.views(),
        engine=state,
        engine_pid=stats["pid"] if engine.alive else None,
        engine_rss_bytes=rss,
        engine_in_flight=int(stats["in_flight"]),
        engine_uptime_secs=round(time.monotonic() - supervisor.recycler.started_at, 1),
        generations=generations,
        ttft_secs=ttft,
        tokens_per_sec=speed,
    )
