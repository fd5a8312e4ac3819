"""``GET /lmsp/v1/summary``: the server's state in one JSON read, for the console's server page
(docs/console.md): the caller's tasks by status, the models, the engine, the recent speed.
Translation only: see lmspd.core.summary."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lmspd import __version__
from lmspd.api import wire
from lmspd.api.models import lmsp_model
from lmspd.api.routing import AUTH, Op, Operation
from lmspd.api.state import state_of


async def summary(request: Request) -> Response:
    app = state_of(request)
    owner = app.auth.owner(request)
    st = await app.core.status.summary(owner)
    body = wire.Summary(
        version=__version__,
        now=st.now,
        ready=st.not_ready is None,
        tasks=wire.TaskCounts(**st.tasks),
        models=[lmsp_model(v) for v in st.models],
        engine=wire.EngineSummary(
            state=st.engine,
            pid=st.engine_pid,
            rss_bytes=st.engine_rss_bytes,
            in_flight=st.engine_in_flight,
            uptime_secs=st.engine_uptime_secs,
            hosts=st.engine_hosts,
        ),
        speed=wire.Speed(
            generations=st.generations,
            ttft_ms=None if st.ttft_secs is None else round(st.ttft_secs * 1e3, 1),
            tokens_per_sec=None if st.tokens_per_sec is None else round(st.tokens_per_sec, 1),
        ),
    )
    return Response(msgspec.json.encode(body), media_type="application/json")


ROUTE = Operation(
    "/lmsp/v1/summary",
    summary,
    Op(
        "The server at a glance: your tasks by status, the models, the engine, the recent speed",
        "lmsp",
        wire.Summary,
        errors=AUTH,
        description=(
            "What the console's server page shows (docs/console.md). Task counts and the engine's "
            "`in_flight` are the caller's own; the models, the engine's state, pid, RSS and uptime, and "
            "the speed (the last 32 generations) are the server's."
        ),
    ),
)
