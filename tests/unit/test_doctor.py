"""``lmspd doctor``: run as a person runs it (a subprocess on a config file), on a healthy data
dir and on a broken one; the port and database checks alone, in process."""

from __future__ import annotations

import http.server
import os
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.server import free_port
from lmspd.cli import doctor
from lmspd.cli.main import main
from lmspd.config import Config, load_config
from lmspd.store.migrate import migrate, migrations

ROOT = Path(__file__).resolve().parents[2]


class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/lmsp/v1/healthz" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def fake_lmspd() -> Iterator[int]:
    """A listener that answers /lmsp/v1/healthz like a running lmspd; yields its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def other_program() -> Iterator[int]:
    """A listener that hangs up on every connection; yields its port."""
    sock = socket.create_server(("127.0.0.1", 0))

    def hang_up() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    yield sock.getsockname()[1]
    sock.close()


def _database(path: Path, user_version: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    migrate(conn)
    if user_version is not None:
        conn.execute(f"PRAGMA user_version = {user_version}")
        conn.commit()
    conn.close()


def _config_file(tmp_path: Path, port: int) -> Path:
    config = tmp_path / "lmspd.toml"
    config.write_text(
        f'cache_dir = "{tmp_path / "models"}"\n[server]\ndata_dir = "{tmp_path / "data"}"\nport = {port}\n'
    )
    return config


def _doctor(tmp_path: Path, port: int) -> subprocess.CompletedProcess[str]:
    config = _config_file(tmp_path, port)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMSPD_", "LMSP_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "lmspd.cli", "doctor", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )


def _lines(out: str) -> dict[str, list[str]]:
    """``{check: ["<level> <detail>", ...]}`` from doctor's columns (level, check, detail)."""
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        found.setdefault(line[6:15].strip(), []).append(f"{line[:4].strip()} {line[17:]}")
    return found


def test_doctor_healthy_install_exits_0(tmp_path: Path, fake_lmspd: int) -> None:
    _database(tmp_path / "data" / "lmspd.db")
    done = _doctor(tmp_path, fake_lmspd)
    assert done.returncode == 0, done.stdout + done.stderr
    found = _lines(done.stdout)
    assert "FAIL" not in done.stdout
    assert found["version"][0].startswith("ok lmspd ")
    assert found["mlx"][0].startswith("ok mlx ") and ", backend " in found["mlx"][0]
    assert found["data dir"][0].startswith(f"ok {tmp_path / 'data'}: ") and " GiB free" in found["data dir"][0]
    latest = len(migrations())
    assert found["schema"] == [f"ok version {latest} of {latest}"]
    assert found["integrity"] == ["ok ok"]
    assert f"ok cache {tmp_path / 'models'}" in found["models"]
    assert any(line.startswith("warn the default model") for line in found["models"])  # the cache is empty
    assert any(line.endswith(": not pulled") for line in found["model"])
    assert found["port"] == [f"ok 127.0.0.1:{fake_lmspd} is in use by a running lmspd (healthz answers)"]


def test_doctor_broken_install_exits_1(
    tmp_path: Path, other_program: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In process (the subprocess run is the test above): MLX's probe is stubbed to save its second.
    monkeypatch.setattr(doctor, "_mlx", lambda: doctor.Finding("ok", "mlx", "stubbed"))
    _database(tmp_path / "data" / "lmspd.db", user_version=99)
    assert main(["doctor", "--config", str(_config_file(tmp_path, other_program))]) == 1
    found = _lines(capsys.readouterr().out)
    assert found["schema"] == [f"FAIL version 99, newer than this lmspd ({len(migrations())}): upgrade lmspd"]
    assert found["integrity"] == ["ok ok"]
    assert found["port"] == [f"FAIL 127.0.0.1:{other_program} is in use by another program"]


def _config(tmp_path: Path, **server: object) -> Config:
    return load_config(
        overrides={"server.data_dir": str(tmp_path), **{f"server.{k}": v for k, v in server.items()}}, environ={}
    )


def test_doctor_database_and_port_checks(tmp_path: Path) -> None:
    config = _config(tmp_path, port=free_port())
    [absent] = doctor._database(config)
    assert absent.level == "ok"
    assert absent.detail.endswith(f"does not exist yet (created at schema {len(migrations())} on first start)")
    assert doctor._port(config).level == "ok"
    config.server.database_path.write_bytes(b"not a database " * 300)
    finding, repair = doctor._database(config)
    assert (finding.level, finding.detail) == (
        "FAIL",
        f"{config.server.database_path}: it is not an SQLite database (its header is not SQLite's)",
    )
    assert repair.level == "FAIL" and "move the file aside" in repair.detail
    remote = _config(tmp_path, host="0.0.0.0", port=free_port())
    assert doctor._port(remote).level == "FAIL"  # no tokens: lmspd serve would refuse this address
