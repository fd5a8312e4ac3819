"""The service layer by concern, one object each, built once by :func:`compose` (the composition
root, :mod:`lmspd.core.runtime`, calls it): every HTTP surface is a view of these and calls the
one its route needs.

- ``intake`` (:mod:`lmspd.core.intake`): a request becomes a durable task, or is counted;
- ``reads`` (:mod:`lmspd.core.reads`): tasks, responses and event logs, replayed and followed;
- ``endings`` (:mod:`lmspd.core.endings`): cancel, a synchronous request's wait, a client gone,
  release, delete;
- ``models`` (:mod:`lmspd.core.model_ops`): load, unload, pin, the engine's recycle;
- ``compaction`` (:mod:`lmspd.core.compact`): ``POST /v1/responses/compact``;
- ``status`` (:mod:`lmspd.core.summary`): readiness, metrics, the console's summary.

Behind them: the ``supervisor`` that runs the tasks, the ``store`` and the ``hub``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmspd.config import Config
from lmspd.core.compact import Compaction
from lmspd.core.endings import Endings
from lmspd.core.hub import Hub
from lmspd.core.intake import Intake
from lmspd.core.model_ops import ModelOps
from lmspd.core.reads import Reads
from lmspd.core.summary import ServerStatus
from lmspd.core.supervisor import Supervisor
from lmspd.metrics import Metrics
from lmspd.models.registry import ModelRegistry
from lmspd.store.task_store import TaskStore

if TYPE_CHECKING:  # psycopg is imported only on PostgreSQL (lmspd.core.runtime)
    from lmspd.core.cluster import Cluster


@dataclass(frozen=True)
class Core:
    intake: Intake
    reads: Reads
    endings: Endings
    models: ModelOps
    compaction: Compaction
    status: ServerStatus
    # What the operators' routes read directly (the cluster's, the store's dialect).
    store: TaskStore
    hub: Hub
    supervisor: Supervisor
    metrics: Metrics
    cluster: Cluster | None = None  # on PostgreSQL: this node among the others

    def begin_shutdown(self) -> None:
        """Stop intake and end every event stream (clients resume with Last-Event-ID)."""
        self.hub.close()

    async def close(self) -> None:
        self.begin_shutdown()
        await self.endings.close()


def compose(
    config: Config,
    store: TaskStore,
    hub: Hub,
    supervisor: Supervisor,
    registry: ModelRegistry,
    metrics: Metrics | None = None,
    cluster: Cluster | None = None,
) -> Core:
    """The service's parts, sharing the supervisor's sealer, reasoning echo and item index
    (each built once, by the composition root)."""
    metrics = metrics or store.metrics
    reads = Reads(config, store, hub, supervisor.storage)
    endings = Endings(config, store, hub, reads, supervisor.cancel)
    live_models = cluster.live_models if cluster is not None else None
    return Core(
        intake=Intake(
            config,
            store,
            hub,
            registry,
            metrics,
            sealer=supervisor.sealer,
            echo=supervisor.echo,
            items=supervisor.items,
            wake=supervisor.wake,
            live_models=live_models,
        ),
        reads=reads,
        endings=endings,
        models=ModelOps(registry, supervisor, lambda task_id: endings.cancel(task_id, None)),
        compaction=Compaction(
            config, hub, registry, supervisor, metrics, sealer=supervisor.sealer, items=supervisor.items
        ),
        status=ServerStatus(store, hub, supervisor, metrics),
        store=store,
        hub=hub,
        supervisor=supervisor,
        metrics=metrics,
        cluster=cluster,
    )
