"""``GET /lmsp/v1/cluster`` (operators): the nodes sharing this server's PostgreSQL, their leases,
models and load (docs/operations.md, "Several nodes"). Translation only: the nodes are
lmspd.core.cluster's; on SQLite there is one node and no lease, and the list is empty."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lmspd import errors as e
from lmspd.api.routing import AUTH, Op, Operation
from lmspd.api.state import state_of
from lmspd.store.nodes import NodeInfo


class Cluster(msgspec.Struct, kw_only=True):
    object: str = "cluster"
    store: str  # "sqlite" or "postgresql"
    node: str | None  # this node's id (None on SQLite)
    epoch: int | None  # its lease epoch
    nodes: list[NodeInfo]


async def cluster(request: Request) -> Response:
    app = state_of(request)
    app.auth.operator(request)
    core = app.core
    found = core.cluster
    body = Cluster(
        store=core.store.db.dialect,
        node=found.node_id if found else None,
        epoch=core.store.fence.epoch,
        nodes=await found.list() if found else [],
    )
    return Response(msgspec.json.encode(body), media_type="application/json")


ROUTES = [
    Operation(
        "/lmsp/v1/cluster",
        cluster,
        Op(
            "The nodes on this server's PostgreSQL: leases, models, load",
            "lmsp",
            Cluster,
            errors=(*AUTH, e.ForbiddenError),
            description="Needs an operator token (`server.admin_tokens`): an ordinary token gets 403.",
        ),
    ),
]
