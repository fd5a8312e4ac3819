"""Chaos with several nodes on one PostgreSQL (``--nodes N --store postgresql://…|temp``).

N ``lmspd serve`` nodes share one database (docs/operations.md, "Several nodes") with a short
lease, so that survivors take a dead node's tasks over within seconds. The load's clients reach a
live node chosen at random for each request, as a DNS round robin in front of them would
(:class:`Spread`). Each cycle kills one node, chosen at random, with SIGKILL (its whole process
group: server and engine) at a random moment while the load runs on the others; it comes back at
once (it settles what it held under a new epoch) or only after a survivor took its tasks over. A
sampler (:class:`Holders`) reads who holds each started task ten times a second: a task may
change node only through the queue or once its holder's lease is gone (``checks.holder_faults``).

``--store temp`` (or none) starts a PostgreSQL of the run's own, as the tests do
(harness/postgres.py: ``initdb`` in a temporary directory, as ``nobody`` under root), with
fsync on; a URL names a database that already runs (its tables are lmspd's, made by the nodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from .checks import (
    EVENT_QUERY,
    KEY_QUERY,
    TASK_COLUMNS,
    DbState,
    Holder,
    holder_faults,
    resumed_mid_generation,
    snapshot_of,
    state_of,
)
from .ledger import Ledger, Snapshot, TaskState
from .load import drain
from .server import ACTIVE, Server, tiny_model, write_config

HEARTBEAT_SECS, LEASE_SECS = 0.5, 3.0
STARTED = ("loading", "running", "cancelling")


@contextlib.contextmanager
def database(store: str | None) -> Iterator[str]:
    """The run's PostgreSQL URL: ``store`` itself, or a temporary cluster's new database."""
    if store not in (None, "", "temp"):
        assert store is not None
        yield store
        return
    from harness.postgres import durable_cluster

    missing = "chaos --nodes: PostgreSQL is not installed (initdb/pg_ctl not found); pass --store URL"
    with durable_cluster(None, missing) as server:
        assert server is not None
        yield server.create_database()


def connect(url: str) -> Any:
    import psycopg  # only with --nodes: the single-node run needs no PostgreSQL driver

    return psycopg.connect(url, autocommit=True)


class Nodes:
    """The N nodes of a run, their database, and what the checks read of it."""

    def __init__(self, data: Path, model: str | None, url: str, count: int) -> None:
        self.url = url
        self.servers: list[Server] = []
        tiny = tiny_model(data) if model is None else None  # one for all the nodes
        for i in range(count):
            home = data / f"n{i + 1}"
            home.mkdir(parents=True)
            cluster = f'node_id = "n{i + 1}"\nheartbeat_secs = {HEARTBEAT_SECS}\nlease_secs = {LEASE_SECS}\n'
            # Its sessions named after it (libpq's application_name), so a kill's end is seen.
            store = f"{url}{'&' if '?' in url else '?'}application_name=n{i + 1}"
            config = write_config(home, model, store=store, cluster=cluster, tiny=tiny)
            self.servers.append(Server(config, home))
        self.up: set[int] = set()  # the nodes serving now (Spread sends requests to these)

    def start(self, i: int) -> None:
        self.servers[i].spawn()
        self.servers[i].ready()
        self.up.add(i)

    def start_all(self) -> None:
        for server in self.servers:
            server.spawn()
        for i, server in enumerate(self.servers):
            server.ready()
            self.up.add(i)

    def kill9(self, i: int) -> None:
        self.up.discard(i)
        self.servers[i].kill9()

    def stop_all(self) -> int:
        """SIGTERM to each (a clean stop); the worst exit code."""
        codes = [s.stop() for s in self.servers if s.proc is not None and s.proc.poll() is None]
        self.up.clear()
        return max((abs(c) for c in codes), default=0)

    def kill_all(self) -> None:
        for i, server in enumerate(self.servers):
            if server.proc is not None and server.proc.poll() is None:
                self.kill9(i)

    def any_url(self) -> str:
        return self.servers[min(self.up)].url

    # --- the database ---------------------------------------------------------------------------

    def count(self, statuses: tuple[str, ...] = ACTIVE, node: str | None = None) -> int:
        sql = "SELECT count(*) FROM tasks WHERE status = ANY(%s)" + (" AND node = %s" if node else "")
        with connect(self.url) as conn:
            return int(conn.execute(sql, (list(statuses), *([node] if node else []))).fetchone()[0])

    def read(self) -> DbState:
        """One consistent snapshot of the whole database while the survivors write on."""
        with connect(self.url) as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            tasks = conn.execute(f"SELECT {TASK_COLUMNS} FROM tasks").fetchall()
            events, keys = conn.execute(EVENT_QUERY).fetchall(), conn.execute(KEY_QUERY).fetchall()
        return state_of(tasks, events, keys, "not checked")

    def held_by(self, node: str) -> dict[str, TaskState]:
        """The tasks ``node`` held started (what its kill interrupted), by id."""
        sql = "SELECT id, status, attempt FROM tasks WHERE node = %s AND status = ANY(%s)"
        with connect(self.url) as conn:
            return {r[0]: TaskState(r[1], r[2]) for r in conn.execute(sql, (node, list(STARTED)))}

    def disconnected(self, node: str, timeout: float = 30) -> None:
        """Wait until PostgreSQL holds no session of the killed ``node``: a COMMIT it sent
        just before SIGKILL is still applied after it died, and what the kill interrupted is
        read only once nothing of it can still land."""
        sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
        deadline = time.monotonic() + timeout
        with connect(self.url) as conn:
            while conn.execute(sql, (node,)).fetchone()[0] and time.monotonic() < deadline:
                time.sleep(0.05)

    def gone(self, node: str) -> bool:
        """Its lease row is gone: a survivor took what it held over."""
        with connect(self.url) as conn:
            return bool(conn.execute("SELECT count(*) FROM nodes WHERE id = %s", (node,)).fetchone()[0] == 0)


class Spread(httpx.AsyncBaseTransport):
    """Each request to a live node chosen at random: a DNS round robin in front of the nodes."""

    def __init__(self, nodes: Nodes, rng: random.Random) -> None:
        self.nodes, self.rng = nodes, rng
        self.inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=200, max_keepalive_connections=50))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self.nodes.up:
            raise httpx.ConnectError("no node is up", request=request)
        target = httpx.URL(self.nodes.servers[self.rng.choice(sorted(self.nodes.up))].url)
        request.url = request.url.copy_with(host=target.host, port=target.port)
        request.headers["Host"] = f"{target.host}:{target.port}"
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Holders(threading.Thread):
    """Samples who holds each started task (and each live lease) until stopped."""

    def __init__(self, url: str, ledger: Ledger, every: float = 0.1) -> None:
        super().__init__(name="chaos holders", daemon=True)
        self.url, self.ledger, self.every = url, ledger, every
        self.done = threading.Event()

    def run(self) -> None:
        before: dict[str, Holder] = {}
        with connect(self.url) as conn:
            while not self.done.wait(self.every):
                with conn.transaction():  # one snapshot: the tasks and the leases as of one moment
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    rows = conn.execute(
                        "SELECT id, node, epoch, queued_at FROM tasks WHERE node IS NOT NULL AND status = ANY(%s)",
                        (list(STARTED),),
                    ).fetchall()
                    live = dict(conn.execute("SELECT id, epoch FROM nodes WHERE expires_at >= now()").fetchall())
                now = {r[0]: (r[1], r[2], r[3]) for r in rows}
                changes, faults = holder_faults(before, now, live)
                self.ledger.holder_samples += 1
                self.ledger.holder_changes += changes
                self.ledger.holder_faults += faults
                before = now

    def stop(self) -> None:
        self.done.set()
        self.join(10)


async def node_cycles(args: Any, nodes: Nodes, ledger: Ledger, load: Any, say: Any) -> None:
    """``args.cycles`` times: one node killed -9 mid-load, then back at once or after take-over."""
    rng = random.Random(args.seed)
    for cycle in range(args.cycles):
        ledger.cycles += 1
        life = asyncio.create_task(load.life("http://nodes", submit=True))
        await asyncio.sleep(rng.uniform(0.5, args.max_kill_delay))
        victim = rng.choice(sorted(nodes.up))
        name = f"n{victim + 1}"
        nodes.kill9(victim)
        # What its kill interrupted (what recovery settles), and the whole database as of then,
        # read in one snapshot while the survivors write on.
        await asyncio.to_thread(nodes.disconnected, name)
        held = await asyncio.to_thread(nodes.held_by, name)
        _, violations = snapshot_of(await asyncio.to_thread(nodes.read))
        ledger.snapshots.append(Snapshot(cycle, held, violations))
        ledger.node_kills += 1
        ledger.running_at_node_kills += sum(s.status == "running" for s in held.values())
        late = rng.random() < 0.5
        if late:  # the survivors settle what it held; the load runs on them meanwhile
            deadline = time.monotonic() + LEASE_SECS + 30
            while not await asyncio.to_thread(nodes.gone, name) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            ledger.node_kills_taken_over += 1
        life.cancel()
        await asyncio.gather(life, return_exceptions=True)
        if not life.cancelled() and life.exception():  # the harness itself broke
            raise RuntimeError("the load failed") from life.exception()
        await asyncio.to_thread(nodes.start, victim)
        say(
            f"cycle {cycle + 1}/{args.cycles}: killed {name} holding {len(held)} started tasks; back "
            f"{'after a survivor took them over' if late else 'at once'}; {len(ledger.acks)} acknowledged so far"
        )


async def node_final_run(args: Any, nodes: Nodes, load: Any, say: Any) -> int:
    """Every node up and clean: readers resume to their end, tasks drain; the worst exit code."""
    began = time.monotonic()
    for i in range(len(nodes.servers)):
        if i not in nodes.up:
            await asyncio.to_thread(nodes.start, i)
    try:
        await asyncio.wait_for(load.life("http://nodes", submit=False), args.drain_timeout)
    except TimeoutError:
        load.ledger.errors.append(f"the readers did not all reach a final event within {args.drain_timeout}s")
    await drain(nodes, args.drain_timeout)
    resumed = resumed_mid_generation(await asyncio.to_thread(nodes.read))
    await load.references(nodes.any_url(), sorted(set(resumed.values())))
    await drain(nodes, args.drain_timeout)
    await load.verify(nodes.any_url())
    say(f"final run: drained in {time.monotonic() - began:.1f}s")
    return nodes.stop_all()
