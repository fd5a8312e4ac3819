"""Prometheus metrics: one :class:`Metrics` per app, on a registry of its own.

Each app (tests make many in one process) gets its own ``CollectorRegistry``, never the
process-wide default one. The layers that see an event count it: the store counts the
tasks it creates and finishes (inside the write transaction, so anyone who can read a
task's new status can already scrape the count), the writer times its group commits,
the supervisor times generation and counts tokens, engine restarts, the prompt cache
and compactions, the event streams count themselves. What the database already knows
(tasks by status) is read when ``/metrics`` is scraped, so it is right after a restart.
Counters start at zero with the process, as Prometheus expects of counters.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

log = logging.getLogger("lmspd.metrics")

__all__ = ["CONTENT_TYPE", "FirstTokenStages", "Metrics", "RecentSpeed", "StatusCounts"]

# No ``*_created`` series (each counter's creation time): they double the output and say nothing
# a scraper does not know from the process start. A process-wide switch; lmspd is the process.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Seconds. Prefill of a short prompt is milliseconds; a long one on a small machine, many seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # the writer's MAX_BATCH is 512


# Where a request's time to first token goes, in order: intake (validation, rendering the
# input to check it, the commit that accepts it), claim (the queue, the supervisor's claim and
# model check, up to ``running``), prompt (history, rendering, tokenizing), engine (the pipe,
# the engine's scheduling, prefill, the first decode step), commit (the first token's event
# committed), deliver (the event read back and written to the client's stream).
STAGES = ("intake", "claim", "prompt", "engine", "commit", "deliver")
# Tasks timed at once; a task whose first token nobody reads (background, no stream) is
# dropped oldest first.
STAGES_OPEN_MAX = 256


class FirstTokenStages:
    """Times each stage of a task's way to its first token. Each layer marks the stage it
    finishes; a mark out of order (a task resumed after a restart, a second reader) is not
    counted, so the figures describe only clean first tokens."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self._open: OrderedDict[str, tuple[int, float]] = OrderedDict()  # task -> (next stage, since)

    def start(self, task_id: str, since: float) -> None:
        """Times a new task from ``since`` (a ``time.perf_counter()`` reading)."""
        self._open[task_id] = (0, since)
        while len(self._open) > STAGES_OPEN_MAX:
            self._open.popitem(last=False)

    def mark(self, task_id: str, stage: str) -> None:
        entry = self._open.get(task_id)
        if entry is None or STAGES[entry[0]] != stage:
            return
        now = time.perf_counter()
        self.histogram.labels(stage).observe(now - entry[1])
        log.debug("first token of %s: %s took %.1f ms", task_id, stage, (now - entry[1]) * 1e3)
        if entry[0] + 1 == len(STAGES):
            del self._open[task_id]
        else:
            self._open[task_id] = (entry[0] + 1, now)


# Generations the console's summary speaks of (GET /lmsp/v1/summary, docs/console.md).
RECENT_GENERATIONS = 32


class RecentSpeed:
    """The last :data:`RECENT_GENERATIONS` generations' speed, for ``GET /lmsp/v1/summary``: a
    figure a person reads on the console, where a histogram's buckets since the start say little."""

    def __init__(self, size: int = RECENT_GENERATIONS) -> None:
        self._seen: deque[tuple[float, int, float]] = deque(maxlen=size)  # (ttft, later tokens, their seconds)

    def add(self, ttft_secs: float, later_tokens: int, later_secs: float) -> None:
        self._seen.append((ttft_secs, later_tokens, later_secs))

    def figures(self) -> tuple[int, float | None, float | None]:
        """(generations, median time to first token in seconds, tokens/s after the first token);
        None where there is nothing to say yet."""
        seen = list(self._seen)
        if not seen:
            return 0, None, None
        ttfts = sorted(t for t, _, _ in seen)
        mid = len(ttfts) // 2
        median = ttfts[mid] if len(ttfts) % 2 else (ttfts[mid - 1] + ttfts[mid]) / 2
        tokens, secs = sum(n for _, n, _ in seen), sum(d for _, _, d in seen)
        return len(seen), median, (tokens / secs if secs > 0 and tokens else None)


class StatusCounts(Protocol):
    async def status_counts(self) -> dict[str, int]: ...


class Metrics:
    """Every metric this service exports, grouped by the layer that counts it."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.recent = RecentSpeed()
        self._tasks(r)
        self._generations(r)
        self._engine(r)
        self._cluster(r)
        self._store(r)  # and the event streams that read it
        self._zero_every_label()

    def _tasks(self, r: CollectorRegistry) -> None:
        self.tasks_created = Counter(
            "lmspd_tasks_created",
            "Tasks accepted, by kind (task: /lmsp/v1/tasks; response: /v1/responses and its views)",
            ["kind"],
            registry=r,
        )
        self.tasks_finished = Counter(
            "lmspd_tasks_finished", "Tasks that reached a terminal status, by that status", ["outcome"], registry=r
        )
        self.tasks = Gauge(
            "lmspd_tasks", "Tasks in the database by status (read at scrape time)", ["status"], registry=r
        )

    def _generations(self, r: CollectorRegistry) -> None:
        self.generations_finished = Counter(
            "lmspd_generations_finished",
            "Task generations that ended, by finish reason (length: the response is incomplete)",
            ["reason"],
            registry=r,
        )
        self.output_tokens = Counter("lmspd_output_tokens", "Tokens generated for tasks", registry=r)
        self.prompt_tokens = Counter("lmspd_prompt_tokens", "Prompt tokens of finished task generations", registry=r)
        self.prompt_cache_hits = Counter(
            "lmspd_prompt_cache_hits", "Task generations whose prompt was partly served by the prompt cache", registry=r
        )
        self.prompt_cached_tokens = Counter(
            "lmspd_prompt_cached_tokens", "Prompt tokens whose KV came from the prompt cache", registry=r
        )
        self.time_to_first_token = Histogram(
            "lmspd_time_to_first_token_seconds",
            "From sending a task's generation to the engine to its first token (prefill; not the queue wait)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.first_token_stages = FirstTokenStages(
            Histogram(
                "lmspd_first_token_stage_seconds",
                "Where the time to a request's first token goes, by stage "
                "(intake, claim, prompt, engine, commit, deliver; see docs/operations.md)",
                ["stage"],
                buckets=STAGE_BUCKETS,
                registry=r,
            )
        )
        self.token_latency = Histogram(
            "lmspd_token_latency_seconds",
            "Time per generated token after the first (one observation per token)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.compactions = Counter(
            "lmspd_compactions",
            "Compactions done, by source (task: context_management; endpoint: /responses/compact)",
            ["source"],
            registry=r,
        )

    def _engine(self, r: CollectorRegistry) -> None:
        self.engine_restarts = Counter("lmspd_engine_restarts", "Engine processes restarted after dying", registry=r)
        self.engine_recycles = Counter(
            "lmspd_engine_recycles",
            "Engines replaced while serving, by reason (age, rss, operator)",
            ["reason"],
            registry=r,
        )
        self.engine_up = Gauge(
            "lmspd_engine_up", "1 when the engine process is running (read at scrape time)", registry=r
        )
        self.model_loads = Counter(
            "lmspd_model_loads", "Models loaded into the engine, by model", ["model"], registry=r
        )
        self.model_unloads = Counter(
            "lmspd_model_unloads",
            "Models unloaded, by reason (idle: past keep_alive_secs; budget: room for another; "
            "operator: an unload call; failed: a failed decode step)",
            ["reason"],
            registry=r,
        )
        self.model_resident_bytes = Gauge(
            "lmspd_model_resident_bytes",
            "Bytes of a loaded model's weights (read at scrape time)",
            ["model"],
            registry=r,
        )
        self.engine_rss_bytes = Gauge(
            "lmspd_engine_rss_bytes", "The engine process's resident set size (read at scrape time)", registry=r
        )
        # A model split over the engine's group of hosts (docs/distributed.md): each rank's part.
        self.model_host_resident_bytes = Gauge(
            "lmspd_model_host_resident_bytes",
            "Bytes of a split model's weights each host of the engine group holds (read at scrape time)",
            ["model", "rank", "host"],
            registry=r,
        )
        self.model_host_layers = Gauge(
            "lmspd_model_host_layers",
            "Layers of a split model each host of the engine group holds (read at scrape time)",
            ["model", "rank", "host"],
            registry=r,
        )

    def _cluster(self, r: CollectorRegistry) -> None:
        # Several nodes on one PostgreSQL (docs/operations.md, "Several nodes"); absent on SQLite.
        self.node_info = Gauge(
            "lmspd_node_info",
            "This node of several: its id and current lease epoch (always 1)",
            ["node", "epoch"],
            registry=r,
        )
        self.cluster_nodes = Gauge(
            "lmspd_cluster_nodes",
            "Nodes on the database by lease, as this node's last heartbeat saw them",
            ["lease"],
            registry=r,
        )
        self.node_leases_lost = Counter(
            "lmspd_node_leases_lost",
            "Times this node found its lease taken over (it was paused past lease_secs)",
            registry=r,
        )
        self.node_tasks_taken_over = Counter(
            "lmspd_node_tasks_taken_over",
            "Unfinished tasks this node took over from nodes whose lease expired",
            registry=r,
        )

    def _store(self, r: CollectorRegistry) -> None:
        self.sse_streams = Gauge("lmspd_sse_streams_open", "Event streams open, by API", ["api"], registry=r)
        self.store_commit = Histogram(
            "lmspd_store_commit_seconds",
            "Duration of one group commit of the store's writer (its jobs, COMMIT and fsync)",
            buckets=COMMIT_BUCKETS,
            registry=r,
        )
        self.store_batch = Histogram(
            "lmspd_store_commit_batch_size", "Jobs in one group commit", buckets=BATCH_BUCKETS, registry=r
        )

    def _zero_every_label(self) -> None:
        """Every label value a dashboard expects is exported from the start, at zero."""
        for kind in ("task", "response"):
            self.tasks_created.labels(kind)
        for outcome in ("succeeded", "failed", "cancelled"):
            self.tasks_finished.labels(outcome)
        for reason in ("stop", "length", "cancelled"):
            self.generations_finished.labels(reason)
        for why in ("age", "rss", "operator"):
            self.engine_recycles.labels(why)
        for why in ("idle", "budget", "operator", "failed"):
            self.model_unloads.labels(why)
        for source in ("task", "endpoint"):
            self.compactions.labels(source)
        for api in ("lmsp", "openai"):
            self.sse_streams.labels(api)
        for stage in STAGES:
            self.first_token_stages.histogram.labels(stage)

    def observe_commit(self, seconds: float, jobs: int) -> None:
        """The store writer's hook: one group commit of ``jobs`` jobs took ``seconds``."""
        self.store_commit.observe(seconds)
        self.store_batch.observe(jobs)

    def observe_engine(
        self, rss_bytes: int, resident: dict[str, int], hosts: dict[str, list[tuple[int, str, int, int]]] | None = None
    ) -> None:
        """The engine's memory as its status says: RSS, each loaded model's weights, and a split
        model's part on each host of the group (rank, host, resident bytes, layers)."""
        self.engine_rss_bytes.set(rss_bytes)
        self.model_resident_bytes.clear()  # an unloaded model's series ends
        for model, nbytes in resident.items():
            self.model_resident_bytes.labels(model).set(nbytes)
        self.model_host_resident_bytes.clear()
        self.model_host_layers.clear()
        for model, shares in (hosts or {}).items():
            for rank, host, nbytes, layers in shares:
                self.model_host_resident_bytes.labels(model, str(rank), host).set(nbytes)
                self.model_host_layers.labels(model, str(rank), host).set(layers)

    def observe_node(self, node: str, epoch: int) -> None:
        self.node_info.clear()  # the previous epoch's series ends
        self.node_info.labels(node, str(epoch)).set(1)

    def observe_cluster(self, live: int, expired: int) -> None:
        self.cluster_nodes.labels("live").set(live)
        self.cluster_nodes.labels("expired").set(expired)

    async def render(self, store: StatusCounts, *, engine_alive: bool) -> bytes:
        """The text exposition, with the scrape-time gauges read first."""
        for status, n in (await store.status_counts()).items():
            self.tasks.labels(status).set(n)
        self.engine_up.set(1 if engine_alive else 0)
        return generate_latest(self.registry)
