"""The server's state in one read, for the console's server page (``GET /lmsp/v1/summary``,
docs/console.md): the owner's tasks by status, the models, the engine and the recent speed.

What could tell one tenant of another's work is the owner's own: the task counts and the engine's
``in_flight`` (the owner's generations on it: its ``running`` tasks, which since docs/lmsp.md §7.2
are exactly the ones the engine decodes). Counting everyone's there would let a token watch
another's queue drain, which ``/metrics``, server-wide, keeps for operators. The rest is the
server's and says so: the engine's state, pid, RSS and uptime, the models (as ``/lmsp/v1/models``
shows any token: a model's ``running`` is bounded by ``max_concurrency``, never a queue) and the
speed of the last generations, whoever ran them."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Literal

from lmspd.core.hub import Hub
from lmspd.core.lifecycle import ModelView
from lmspd.core.supervisor import Supervisor
from lmspd.engine.protocol import GroupHost
from lmspd.errors import LmspdError
from lmspd.metrics import Metrics
from lmspd.store.task_store import TaskStore

EngineState = Literal["up", "down", "recycling"]


@dataclass(frozen=True)
class ServerState:
    now: int  # unix seconds on the server (the page counts unload times down from it)
    not_ready: str | None  # why /readyz answers 503 (None: ready)
    tasks: dict[str, int]  # the owner's tasks by status, every status named
    models: list[ModelView]
    engine: EngineState
    engine_pid: int | None
    engine_rss_bytes: int | None  # None when the engine is down
    engine_in_flight: int  # the owner's generations on the engine (its running tasks)
    engine_uptime_secs: float
    engine_hosts: list[GroupHost] | None  # its group of hosts, rank 0 first (None: one process)
    generations: int  # how many recent generations the speed figures describe
    ttft_secs: float | None  # their median time to first token
    tokens_per_sec: float | None  # their decode speed after the first token


async def server_state(
    owner: str, *, store: TaskStore, supervisor: Supervisor, metrics: Metrics, not_ready: str | None
) -> ServerState:
    engine = supervisor.engine
    rss: int | None = None
    if engine.alive:
        with contextlib.suppress(LmspdError):  # dying now: reported down on the next read
            rss = (await engine.status()).rss_bytes
    state: EngineState = "recycling" if supervisor.recycler.busy else ("up" if engine.alive else "down")
    stats = engine.stats()
    generations, ttft, speed = metrics.recent.figures()
    tasks = await store.owner_status_counts(owner)
    return ServerState(
        now=int(time.time()),
        not_ready=not_ready,
        tasks=tasks,
        models=await supervisor.lifecycle.views(),
        engine=state,
        engine_pid=stats["pid"] if engine.alive else None,
        engine_rss_bytes=rss,
        engine_in_flight=tasks.get("running", 0),
        engine_uptime_secs=round(time.monotonic() - supervisor.recycler.started_at, 1),
        engine_hosts=(engine.info.hosts or None) if engine.info is not None else None,
        generations=generations,
        ttft_secs=ttft,
        tokens_per_sec=speed,
    )


class ServerStatus:
    """The server as probes, scrapers and the console read it: ``/readyz``, ``/metrics`` and
    ``GET /lmsp/v1/summary``."""

    def __init__(self, store: TaskStore, hub: Hub, supervisor: Supervisor, metrics: Metrics) -> None:
        self.store = store
        self.hub = hub
        self.supervisor = supervisor
        self.metrics = metrics

    def not_ready(self) -> str | None:
        """Why ``/readyz`` answers 503 (None: ready). Read on every probe: nothing here loads
        or reads a model (the default model's verdict was decided at its preload)."""
        if self.hub.closing.is_set():
            return "the server is shutting down"
        if not self.supervisor.engine.alive:
            why = self.supervisor.engine.last_error
            return f"the engine is down (it is restarted): {why}" if why else "the engine is down (it is restarted)"
        return self.supervisor.default_refused

    def serving_alone(self) -> str | None:
        """Why an engine configured for a group of hosts serves alone (None: it does not)."""
        info = self.supervisor.engine.info
        if info is None or not info.alone:
            return None
        return f"serving alone (engine.group_continue_alone): {info.alone}"

    async def summary(self, owner: str) -> ServerState:
        """``owner``'s task counts, the models, the engine and the recent speed."""
        return await server_state(
            owner, store=self.store, supervisor=self.supervisor, metrics=self.metrics, not_ready=self.not_ready()
        )

    async def metrics_text(self) -> bytes:
        """``/metrics``: the Prometheus text exposition."""
        await self.supervisor.lifecycle.observe()
        return await self.metrics.render(self.store, engine_alive=self.supervisor.engine.alive)
