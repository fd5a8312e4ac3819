"""`lmspd serve` on a PostgreSQL it cannot use: refused in one line and exit 1 before anything
starts (systemd restarts it), a password in the URL never in its output; a database newer than
this lmspd is refused, an older one migrated (tests/unit/test_store.py). Real processes, a real
PostgreSQL (harness/postgres.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from harness.server import free_port
from lmspd.store.pg_migrate import latest_version

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-not-in-logs"


def serve(tmp_path: Path, url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMSPD_", "LMSP_", "PG"))}
    env |= {"LMSPD_STORE_URL": url, "PYTHONPATH": str(ROOT)}
    config = tmp_path / "lmspd.toml"
    config.write_text(
        f'default_model = "tiny"\ncache_dir = "{tmp_path / "models"}"\n[server]\ndata_dir = "{tmp_path / "data"}"\n'
        f'[models.tiny]\npath = "{tmp_path / "no-model"}"\n'
    )
    cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(config), "--port", str(free_port())]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_postgresql_down_at_start_is_one_line_without_the_password(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens there
    run = serve(tmp_path, f"postgresql://lmspd:{SECRET}@127.0.0.1:{closed}/lmspd?password={SECRET}")
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "Traceback" not in output and SECRET not in output
    [line] = [line for line in output.splitlines() if "ERROR" in line]
    assert f"cannot start: the PostgreSQL database postgresql://lmspd:***@127.0.0.1:{closed}/lmspd" in line
    assert "password=***" in line and "run `lmspd doctor`" in line


def test_a_newer_schema_is_refused_and_left_as_it_is(tmp_path: Path, pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE lmspd_schema SET version = 99")
    run = serve(tmp_path, pg_url)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    [line] = [line for line in output.splitlines() if "ERROR" in line]
    assert f"its schema version is 99, newer than this lmspd's ({latest_version()}): upgrade lmspd" in line
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT version FROM lmspd_schema").fetchall() == [(99,)]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:pw@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgresql://h/db?password=pw&sslmode=require", "postgresql://h/db?password=***&sslmode=require"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
    ],
)
def test_a_url_is_shown_without_its_password(url: str, shown: str) -> None:
    from lmspd.store.url import StoreUrl

    assert str(StoreUrl.parse(url, Path("unused"))) == shown


def test_doctor_checks_postgresql_read_only(pg_url: str) -> None:
    from lmspd.cli import doctor
    from lmspd.config import Config, StoreConfig

    found = {f.check: f for f in doctor._database(Config(store=StoreConfig(url=pg_url)))}
    assert found["database"].level == "ok" and "(PostgreSQL " in found["database"].detail
    latest = latest_version()  # migrations/postgresql/
    assert (found["schema"].level, found["schema"].detail) == ("ok", f"version {latest} of {latest}")
    assert found["clock"].level == "ok" and "from the database's" in found["clock"].detail
    assert found["nodes"].detail.startswith("0 nodes, 0 with an expired lease")
    down = f"postgresql://lmspd:{SECRET}@127.0.0.1:{free_port()}/lmspd"
    [refused] = doctor._database(Config(store=StoreConfig(url=down)))
    assert refused.level == "FAIL" and "cannot be used" in refused.detail and SECRET not in refused.detail
