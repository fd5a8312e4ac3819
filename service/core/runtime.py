"""The composition root: everything a running service is made of, built in order and stopped in
reverse. The app's lifespan (:func:`lmspd.api.app.create_app`) enters :func:`started` and
serves the :class:`~lmspd.core.Core` it yields; tests and benchmarks can enter it without HTTP.

Also the service's chores while it runs: the retention janitor and the shutdown watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from lmspd.config import Config
from lmspd.core.hub import Hub
from lmspd.core.service import Core, compose
from lmspd.core.supervisor import Supervisor
from lmspd.engine.process import EngineClient
from lmspd.engine.protocol import SamplingParams
from lmspd.errors import LmspdError, StorageFullError
from lmspd.metrics import Metrics
from lmspd.models.registry import ModelRegistry
from lmspd.prompting.generation import check_request
from lmspd.responses.reasoning_echo import ReasoningEcho
from lmspd.responses.sealing import KEY_FILE, Sealer
from lmspd.store import secrets
from lmspd.store.items import ItemIndex
from lmspd.store.opening import open_database
from lmspd.store.task_store import TaskStore
from lmspd.store.url import StoreUrl

if TYPE_CHECKING:
    from lmspd.core.cluster import Cluster

log = logging.getLogger("lmspd.server")


@contextlib.asynccontextmanager
async def started(
    config: Config, engine: EngineClient | None = None, shutdown: asyncio.Event | None = None
) -> AsyncIterator[Core]:
    """A started service. ``engine``: one the caller started and keeps (tests share one);
    ``shutdown``: set by the process on SIGTERM, so intake stops and event streams end."""
    # Whatever started is stopped again, in reverse order, also when a later step fails: an
    # open database or engine left behind keeps a failed server alive, never serving.
    async with contextlib.AsyncExitStack() as stack:
        metrics = Metrics()  # this service's own registry: many apps may share a process
        where = StoreUrl.parse(config.store.url, config.server.database_path)
        db = await open_database(where, on_commit=metrics.observe_commit)
        stack.push_async_callback(db.close)
        store = TaskStore(db, max_queued=config.server.max_queued_tasks, metrics=metrics)
        hub = Hub()
        registry = ModelRegistry(config)
        runner = engine or EngineClient(config.engine, config.server.prompt_cache_dir)
        # Reasoning sealed for clients that keep no state: one key for every node of a cluster.
        pg = db.dialect == "postgresql"
        if pg:
            sealer = Sealer(await secrets.shared(db, KEY_FILE, Sealer.new_key))
        else:
            sealer = Sealer.at(config.server.database_path.parent)
        # Built once, shared by intake and the supervisor (lmspd.core.service.compose).
        echo, items = ReasoningEcho.of(config, db), ItemIndex(db)
        supervisor = Supervisor(config, store, runner, hub, registry, metrics, sealer, echo, items)
        cluster: Cluster | None = None
        if pg:  # one node of several (docs/operations.md, "Several nodes"): its lease first
            from lmspd.core.cluster import Cluster  # psycopg only when on PostgreSQL

            cluster = Cluster(config, db, store, hub)  # type: ignore[arg-type]
            await cluster.join()
        # A handed-in engine is the caller's to close.
        stack.push_async_callback(supervisor.stop, close_engine=engine is None)
        await supervisor.start()  # recovers unfinished tasks before any request is served
        if cluster is not None:
            cluster.start(supervisor)
            stack.push_async_callback(cluster.stop)
        # Foreground store:false responses a crash left between their end and their release. Only
        # at start: while serving, a slow reader may still be streaming a finished one.
        with contextlib.suppress(StorageFullError):  # deleting needs room too: the janitor retries
            await store.delete_finished_unstored()
        core = compose(config, store, hub, supervisor, registry, metrics, cluster)
        stack.push_async_callback(core.close)
        await asyncio.to_thread(_warm_up, config, registry)
        chores = [asyncio.create_task(_janitor(config, store))]
        if shutdown is not None:
            chores.append(asyncio.create_task(_on_shutdown(shutdown, core)))
        for chore in chores:
            stack.callback(chore.cancel)
        yield core


async def _janitor(config: Config, store: TaskStore) -> None:
    s = config.server
    while True:
        await asyncio.sleep(s.janitor_interval_secs)
        try:
            counts = await store.purge(
                event_retention_secs=s.event_retention_secs,
                task_retention_secs=s.task_retention_secs,
                idempotency_retention_secs=s.idempotency_retention_secs,
            )
            evicted = await store.enforce_response_limits(config.responses)
            log.info("retention purge: %s; response store evictions: %d", counts, evicted)
        except StorageFullError as exc:
            log.warning("retention purge postponed: %s", exc.message)
        except Exception:
            log.exception("retention purge failed")


def _warm_up(config: Config, registry: ModelRegistry) -> None:
    """Load the default model's tokenizer and compile its chat template before the first request."""
    with contextlib.suppress(LmspdError):
        if (model := registry.resolve_local(config.default_model)) is not None:
            check_request(model, [{"role": "user", "content": "warm-up"}], SamplingParams())


async def _on_shutdown(shutdown: asyncio.Event, core: Core) -> None:
    await shutdown.wait()
    log.info("shutting down: no new work; in-flight tasks stay recoverable by their policy")
    core.begin_shutdown()
