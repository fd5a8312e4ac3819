"""A damaged database at start: ``lmspd serve`` refuses it in one line and exits non-zero,
never hangs, never changes the file; ``lmspd doctor`` says what is wrong with it. And one
unreadable task does not keep the others from being recovered.

Each variant is a real ``lmspd serve`` process; they all start at once (each spends its
seconds importing), so the module costs about one start, not one per variant."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from harness.disk import fill, read_only, small_disk
from harness.engine_host import tiny_config
from harness.server import free_port
from harness.wait import wait_until_async
from lmspd.api.app import create_app
from lmspd.cli import doctor
from lmspd.cli.serve import startup_error
from lmspd.config import Config, EngineConfig, ServerConfig
from lmspd.core.hub import Hub
from lmspd.core.supervisor import Supervisor
from lmspd.engine.process import EngineClient
from lmspd.errors import EngineCrashedError
from lmspd.models.registry import ModelRegistry, ResolvedModel
from lmspd.store.check import DatabaseUnusableError
from lmspd.store.conn import Conn
from lmspd.store.db import Database
from lmspd.store.task_store import NewEvent, TaskRecord, TaskStore

ROOT = Path(__file__).resolve().parents[2]
EXIT_BOUND_SECS = 60.0  # generous for a loaded machine; before the fix, these never exited


def _event(task: TaskRecord, seq: int) -> NewEvent:
    return NewEvent("response.created", msgspec.json.encode({"type": "x", "seq": seq, "pad": "p" * 900}))


async def _make_base(path: Path) -> None:
    """A real lmspd database of some hundred pages: queued tasks, their events."""
    db = await Database.open(path)
    store = TaskStore(db, max_queued=10_000)
    await asyncio.gather(
        *(store.create(owner="alice", request=b"{}", on_restart="fail", first_event=_event) for _ in range(300))
    )
    await db.close()


def _sql(*statements: str) -> Callable[[bytes, Path], None]:
    def damage(data: bytes, path: Path) -> None:
        path.write_bytes(data)
        with sqlite3.connect(path, isolation_level=None) as conn:
            for statement in statements:
                conn.execute(statement)
        conn.close()

    return damage


def _bytes(change: Callable[[bytes], bytes]) -> Callable[[bytes, Path], None]:
    def damage(data: bytes, path: Path) -> None:
        path.write_bytes(change(data))

    return damage


def _garbage(n: int) -> bytes:
    return bytes((i * 131 + 7) % 256 for i in range(n))


VARIANTS: dict[str, tuple[Callable[[bytes, Path], None], str]] = {
    "truncated_half": (_bytes(lambda d: d[: len(d) // 2]), "it is damaged"),
    "truncated_to_50_bytes": (_bytes(lambda d: d[:50]), "it is truncated"),
    "garbage_header": (_bytes(lambda d: _garbage(100) + d[100:]), "it is not an SQLite database"),
    "garbage_second_half": (_bytes(lambda d: d[: len(d) // 2] + _garbage(len(d) - len(d) // 2)), "it is damaged"),
    "zeroed_pages": (_bytes(lambda d: d[:4096] + bytes(3 * 4096) + d[4 * 4096 :]), "it is damaged"),
    "zeroed_last_page": (_bytes(lambda d: d[:-4096] + bytes(4096)), "it is damaged"),
    "not_sqlite": (_bytes(lambda d: b"this is not a database\n" * 200), "it is not an SQLite database"),
    "dropped_table": (_sql("DROP TABLE events"), "lacks table events"),
    "dropped_trigger": (_sql("DROP TRIGGER task_counts_insert"), "lacks trigger task_counts_insert"),
    "future_version": (_sql("PRAGMA user_version = 99"), "newer than this lmspd's"),
    "another_programs_database": (
        lambda data, path: _sql("CREATE TABLE tasks (x)", "INSERT INTO tasks VALUES (1)")(b"", path),
        "it is not an lmspd database",
    ),
}
PORT_IN_USE = "port_in_use"  # a sound database, but the address is taken


@dataclass
class Run:
    db: Path
    before: bytes
    returncode: int | None
    seconds: float
    output: str


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    base = tmp_path_factory.mktemp("base") / "lmspd.db"
    asyncio.run(_make_base(base))
    data = base.read_bytes()
    assert len(data) > 100 * 4096
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMSPD_", "LMSP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    started: dict[str, tuple[subprocess.Popen[bytes], Path, Path, bytes, float]] = {}
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    sound = _bytes(lambda data: data)
    for name, damage in [*((name, damage) for name, (damage, _) in VARIANTS.items()), (PORT_IN_USE, sound)]:
        tmp = tmp_path_factory.mktemp(name)
        (tmp / "data").mkdir()
        db = tmp / "data" / "lmspd.db"
        damage(data, db)
        for leftover in db.parent.glob("lmspd.db-*"):  # the damage is in the file itself
            leftover.unlink()
        config = tmp / "lmspd.toml"
        # Refused before any model is looked at: none is needed.
        config.write_text(
            f'default_model = "tiny"\ncache_dir = "{tmp / "models"}"\n[server]\ndata_dir = "{tmp / "data"}"\n'
            f'[models.tiny]\npath = "{tmp / "no-model"}"\n'
        )
        log = tmp / "server.log"
        port = taken.getsockname()[1] if name == PORT_IN_USE else free_port()
        cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(config), "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp)
        started[name] = (proc, db, log, db.read_bytes(), time.monotonic())
    found: dict[str, Run] = {}
    for name, (proc, db, log, before, start) in started.items():
        try:
            code: int | None = proc.wait(max(0.1, start + EXIT_BOUND_SECS - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            code = None
        found[name] = Run(db, before, code, time.monotonic() - start, log.read_text())
    taken.close()
    return found


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_serve_refuses_a_damaged_database_in_one_line(runs: dict[str, Run], variant: str) -> None:
    run = runs[variant]
    assert run.returncode is not None, f"still running after {EXIT_BOUND_SECS}s:\n{run.output}"
    assert run.returncode == 1, run.output
    assert "Traceback" not in run.output
    [line] = [line for line in run.output.splitlines() if "ERROR" in line]
    assert f"cannot start: the database {run.db} cannot be used: " in line
    assert VARIANTS[variant][1] in line
    assert "run `lmspd doctor`" in line
    assert run.db.read_bytes() == run.before, "the refused file was changed"


def test_serve_refuses_a_taken_port_in_one_line(runs: dict[str, Run]) -> None:
    run = runs[PORT_IN_USE]
    assert run.returncode == 1, run.output
    assert "Traceback" not in run.output
    [line] = [line for line in run.output.splitlines() if "ERROR" in line]
    assert "cannot start: cannot listen on 127.0.0.1:" in line and "run `lmspd doctor`" in line
    assert run.db.read_bytes() == run.before


async def test_a_failed_start_stops_what_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the database opened (here: the engine) closes it again, so no thread
    keeps the process alive, and `lmspd serve` learns the cause to say it in one line."""

    async def engine_dies(self: Supervisor) -> None:
        raise EngineCrashedError("the engine process exited (code 1)")

    monkeypatch.setattr(Supervisor, "start", engine_dies)
    config = Config(server=ServerConfig(data_dir=str(tmp_path)))
    app = create_app(config)
    before = set(threading.enumerate())
    with pytest.raises(EngineCrashedError):
        async with app.router.lifespan_context(app):
            pass

    def left() -> list[threading.Thread]:  # asyncio's own executor threads end with the loop
        return [t for t in threading.enumerate() if t not in before and not t.daemon and "asyncio" not in t.name]

    await wait_until_async(lambda: not left(), lambda: f"the start's threads to end: {left()}", timeout=5)
    message = startup_error(config, app.state.startup_error).message
    assert message == (
        f"the engine process exited (code 1) (database {config.server.database_path}); run `lmspd doctor` for details"
    )


def test_serve_says_a_full_or_read_only_disk_is_one_not_a_damaged_database(tmp_path: Path) -> None:
    """A sound database on a full disk, and one on a read-only disk (each a tmpfs of its
    own): ``lmspd serve`` refused both in one line, but said "it is damaged" (SQLite's
    "disk I/O error" and "unable to open database file" when it cannot make the -shm and
    -wal files). Now it says what is wrong, and so does ``lmspd doctor``."""
    expected = {"full": "is full (", "read_only": "is read-only"}
    with contextlib.ExitStack() as stack:
        procs: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
        for name in expected:
            data = stack.enter_context(small_disk(tmp_path / name / "data", 4 << 20))
            asyncio.run(_make_base(data / "lmspd.db"))
            for leftover in data.glob("lmspd.db-*"):
                leftover.unlink()
            if name == "full":
                fill(data)
            else:
                read_only(data)
                stack.callback(read_only, data, False)
            config = tmp_path / name / "lmspd.toml"
            config.write_text(
                f'default_model = "tiny"\ncache_dir = "{tmp_path / "models"}"\n[server]\ndata_dir = "{data}"\n'
                f'[models.tiny]\npath = "{tmp_path / "no-model"}"\n'
            )
            log = tmp_path / name / "server.log"
            cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(config), "--port", str(free_port())]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("LMSPD_", "LMSP_"))}
            proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
            procs[name] = (proc, data, log)
        for name, (proc, data, log) in procs.items():
            try:
                code = proc.wait(EXIT_BOUND_SECS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                raise AssertionError(f"{name}: still running after {EXIT_BOUND_SECS}s:\n{log.read_text()}") from None
            output = log.read_text()
            assert code == 1 and "Traceback" not in output, output
            [line] = [line for line in output.splitlines() if "ERROR" in line]
            assert f"cannot start: the database {data / 'lmspd.db'} cannot be used: the disk holding it" in line
            assert expected[name] in line and "damaged" not in line, line
            findings = doctor._database(Config(server=ServerConfig(data_dir=str(data))))
            failed = [f.detail for f in findings if f.level == "FAIL"]
            assert failed and expected[name] in failed[0] and "damaged" not in failed[0], findings


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_doctor_says_what_is_wrong(runs: dict[str, Run], variant: str) -> None:
    run = runs[variant]
    config = Config(server=ServerConfig(data_dir=str(run.db.parent)))
    findings = doctor._database(config)
    failed = [f.detail for f in findings if f.level == "FAIL"]
    assert failed, findings
    expected = VARIANTS[variant][1].replace("newer than this lmspd's", "newer than this lmspd")
    assert expected in failed[0]
    assert run.db.read_bytes() == run.before


async def test_database_open_refuses_without_writing(tmp_path: Path) -> None:
    path = tmp_path / "lmspd.db"
    await _make_base(path)
    before = path.read_bytes()
    half = len(before) // 2
    path.write_bytes(before[:half] + _garbage(len(before) - half))
    damaged = path.read_bytes()
    with pytest.raises(DatabaseUnusableError, match="it is damaged"):
        await Database.open(path)
    assert path.read_bytes() == damaged


async def test_one_unreadable_task_fails_alone(tmp_path: Path, tiny: ResolvedModel, model_cache: Path) -> None:
    """Running tasks at restart: one without events, one with an undecodable event, one
    sound. The two damaged ones fail with ``task_corrupt``; the sound one is recovered."""
    config = tiny_config(tiny, model_cache, tmp_path)
    db = await Database.open(config.server.database_path)
    store = TaskStore(db)
    from lmspd.core.service import compose  # the intake path writes the first event as it really is

    hub = Hub()
    supervisor = Supervisor(config, store, EngineClient(EngineConfig()), hub, ModelRegistry(config))
    core = compose(config, store, hub, supervisor, ModelRegistry(config), store.metrics)
    from lmspd.responses.checks import accept
    from lmspd.responses.schema import ResponseRequest

    request = msgspec.json.decode(b'{"input": "hi", "max_output_tokens": 4}', type=ResponseRequest)
    accepted = accept(request)
    ids = [(await core.intake.submit("alice", accepted, kind="task", on_restart="retry"))[0].id for _ in range(3)]
    empty, garbled, sound = ids

    def damage(conn: Conn) -> None:
        conn.execute("UPDATE tasks SET status = 'running'")
        conn.execute("DELETE FROM events WHERE task_id = ?", (empty,))
        conn.execute("UPDATE events SET data = x'00ff' WHERE task_id = ?", (garbled,))

    await db.writer.submit(damage)
    await supervisor.transitions.recover()
    for task_id in (empty, garbled):
        task = await store.get(task_id)
        assert task.status == "failed"
        assert task.error is not None and msgspec.json.decode(task.error)["code"] == "task_corrupt"
    recovered = await store.get(sound)
    assert (recovered.status, recovered.attempt) == ("queued", 2)
    await db.close()


def test_the_base_database_is_sound(tmp_path: Path) -> None:
    """The variants above are damage, not a base the check would refuse anyway."""
    path = tmp_path / "lmspd.db"
    asyncio.run(_make_base(path))
    shutil.copy(path, tmp_path / "copy.db")
    from lmspd.store.check import problem

    assert problem(tmp_path / "copy.db") is None
