"""One engine process shared by many apps, each app with its own database.

An :class:`EngineClient` belongs to the event loop it was started on (its reader thread
hands every reply to that loop), while each ``with TestClient(app)`` runs the app on a
fresh loop of its own. So a test module starts one loop thread (an anyio blocking portal)
and one engine on it, and :func:`serve` runs every test's app on that same loop: the
app's lifespan is entered in the portal and the TestClient sends its requests through the
portal instead of starting its own. The app's lifespan does not close an engine it was
handed; whoever started it closes it.

Modules on the same engine config share one host for the whole session (:class:`Hosts`,
the ``engine_hosts`` fixture), each app still with its own database.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.from_thread
import msgspec
from anyio.from_thread import BlockingPortal
from starlette.applications import Starlette
from starlette.testclient import TestClient

from lmspd.api.app import create_app
from lmspd.config import Config, EngineConfig, ModelEntry, ServerConfig
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ResolvedModel


@dataclass(frozen=True)
class Host:
    portal: BlockingPortal
    engine: EngineClient
    # The path each model name was last served from: the engine knows a loaded model by its
    # name, and modules give one name ("tiny") different directories.
    paths: dict[str, str] = field(default_factory=dict)

    @contextlib.contextmanager
    def serve(self, config: Config) -> Iterator[TestClient]:
        """A TestClient for a new app on ``config`` that uses the shared engine."""
        assert config.engine == self.engine.config, "the app's engine settings must be the shared engine's"
        for name, entry in config.models.items():
            if self.paths.get(name, entry.path) != entry.path:
                self.portal.call(functools.partial(self.engine.unload, name, force=True))
            self.paths[name] = entry.path
        app = create_app(config, engine=self.engine)
        with serve(app, self.portal) as client:
            yield client


@contextlib.contextmanager
def serve(app: Starlette, portal: BlockingPortal) -> Iterator[TestClient]:
    """Like ``with TestClient(app)``, but on ``portal``'s event loop."""
    with portal.wrap_async_context_manager(app.router.lifespan_context(app)):
        # Not entered with ``with``: that would start a loop of its own and the lifespan again.
        client = TestClient(app, base_url="http://127.0.0.1")  # a loopback Host (lmspd.api.guard)
        client.portal = portal  # requests run on the shared loop
        try:
            yield client
        finally:
            client.close()


@contextlib.contextmanager
def engine_host(config: EngineConfig) -> Iterator[Host]:
    """An event loop thread and an engine started on it, closed on exit."""
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        engine = EngineClient(config)
        portal.call(engine.start)
        try:
            yield Host(portal, engine)
        finally:
            portal.call(engine.close)


class Hosts:
    """Engine hosts shared by the test modules of a session, one per engine config: each
    engine start costs seconds, and modules on the same config need no engine of their own."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._hosts: dict[bytes, Host] = {}

    def get(self, config: EngineConfig) -> Host:
        key = msgspec.json.encode(config)
        host = self._hosts.get(key)
        if host is None:
            host = self._hosts[key] = self._stack.enter_context(engine_host(config))
        elif not host.engine.alive:
            # Killed by an earlier module's test (its app's supervisor restarts it, but only
            # while that app runs): start it again, as a supervisor would.
            host.portal.call(host.engine.start)
        return host


def purge(client: TestClient, *, events_older_than: int = 10**6, later_by: int = 10) -> None:
    """Run the retention janitor's purge as if ``later_by`` seconds had passed (events of
    tasks finished more than ``events_older_than`` seconds before then are dropped)."""
    store = client.app.state.lmsp.core.store  # type: ignore[attr-defined]
    assert client.portal is not None
    client.portal.call(
        lambda: store.purge(
            event_retention_secs=events_older_than,
            task_retention_secs=10**6,
            idempotency_retention_secs=10**6,
            now=int(time.time()) + later_by,
        )
    )


def tiny_config(
    model: ResolvedModel, cache: Path, data_dir: Path, engine: EngineConfig | None = None, **server: Any
) -> Config:
    """A server config whose default model, "tiny", is ``model``; ``server``: ServerConfig's
    fields besides the data directory."""
    return Config(
        default_model="tiny",
        cache_dir=str(cache),
        models={"tiny": ModelEntry(path=str(model.path))},
        engine=engine or EngineConfig(),
        server=ServerConfig(data_dir=str(data_dir), **server),
    )
