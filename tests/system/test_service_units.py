"""Service units: the shipped and printed systemd unit and launchd plist, and sd_notify against a
real ``lmspd serve`` (READY=1 only once /readyz answers 200, STOPPING=1 on SIGTERM; a default
model the memory budget refuses: serving, not ready, STATUS saying why and never READY=1)."""

from __future__ import annotations

import os
import plistlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import tiny_server
from harness.wait import wait_until
from lmspd.cli.main import main
from lmspd.cli.systemd import notify
from lmspd.cli.units import EXAMPLE_EXECUTABLE, examples, install_for, launchd_plist, systemd_unit
from lmspd.config import load_config
from lmspd.models.registry import ResolvedModel

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
LAUNCHD_KEYS = {"Label", "ProgramArguments", "KeepAlive", "RunAtLoad", "StandardOutPath", "StandardErrorPath"}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> values (keys like Environment= repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current.setdefault(key, []).append(value)
    return sections


@pytest.fixture
def fake_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A venv-like bin/ with python and an executable lmspd, as sys.executable; no LMSPD_* env."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "lmspd"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    for var in [v for v in os.environ if v.startswith("LMSPD_")]:
        monkeypatch.delenv(var)
    return exe


def test_shipped_units_are_the_printed_ones() -> None:
    for name, content in examples().items():
        assert (DEPLOY / name).read_bytes() == content, f"deploy/{name} is stale: run python -m lmspd.cli.units"


def test_shipped_systemd_unit() -> None:
    unit = parse_unit((DEPLOY / "lmspd.service").read_text())
    s = unit["Service"]
    assert s["Type"] == ["notify"]
    assert s["User"] == ["lmspd"]
    assert s["ExecStart"] == [f"{EXAMPLE_EXECUTABLE} serve"]
    assert s["Restart"] == ["on-failure"]
    assert s["KillSignal"] == ["SIGTERM"]
    assert s["KillMode"] == ["mixed"]  # the engine process is stopped by lmspd, not signalled with it
    assert int(s["TimeoutStopSec"][0]) > load_config(environ={}).server.shutdown_grace_secs
    for option in ("NoNewPrivileges", "PrivateTmp", "ProtectHome"):
        assert s[option] == ["yes"], option
    assert s["ProtectSystem"] == ["strict"]
    assert s["ReadWritePaths"] == ["/var/lib/lmspd /var/cache/lmspd"]
    assert {"LMSPD_DATA_DIR=/var/lib/lmspd", "LMSPD_CACHE_DIR=/var/cache/lmspd"} <= set(s["Environment"])
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_print_systemd_for_this_install(fake_install: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "lmspd.toml"
    config.write_text("[server]\nshutdown_grace_secs = 45\n")
    data = "/home/someone/lm spd 100%"
    assert main(["service", "print", "--systemd", "--config", str(config), "--data-dir", data]) == 0
    s = parse_unit(capsys.readouterr().out)["Service"]
    assert s["ExecStart"] == [f"{fake_install} serve"]
    assert s["TimeoutStopSec"] == ["65"]  # above the configured grace
    assert s["Environment"] == [
        '"LMSPD_DATA_DIR=/home/someone/lm spd 100%%"',
        "LMSPD_CACHE_DIR=/var/cache/lmspd",
        f"LMSPD_CONFIG={config}",
        "HF_HOME=/var/cache/lmspd/huggingface",
    ]
    assert s["ReadWritePaths"] == ['"/home/someone/lm spd 100%%" /var/cache/lmspd']
    assert s["ProtectHome"] == ["read-only"]  # the data dir is under /home: readable, writable by ReadWritePaths
    assert s["CacheDirectory"] == ["lmspd"] and "StateDirectory" not in s

    assert main(["service", "print", "--systemd", "--user"]) == 0
    unit = parse_unit(capsys.readouterr().out)
    s, defaults = unit["Service"], load_config()
    assert "User" not in s and "ProtectSystem" not in s
    assert s["Environment"] == [
        f"LMSPD_DATA_DIR={defaults.server.database_path.parent}",
        f"LMSPD_CACHE_DIR={defaults.model_cache_dir}",
    ]
    assert s["Type"] == ["notify"] and s["NoNewPrivileges"] == ["yes"]
    assert unit["Install"]["WantedBy"] == ["default.target"]


def test_systemd_analyze_verify(fake_install: Path, tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed: the units' syntax is not verified here")
    config = load_config(environ={}, overrides={"server.data_dir": "/srv/lm spd %i", "cache_dir": "/var/cache/x/y"})
    shipped = (DEPLOY / "lmspd.service").read_text().replace(str(EXAMPLE_EXECUTABLE), str(fake_install))
    units = {
        "shipped": shipped,
        "system": systemd_unit(install_for(config, launchd=False, user=False)),
        "user": systemd_unit(install_for(config, launchd=False, user=True)),
    }
    for name, text in units.items():
        path = tmp_path / name / "lmspd.service"
        path.parent.mkdir()
        path.write_text(text)
        done = subprocess.run([tool, "verify", str(path)], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout + done.stderr) == (0, ""), f"{name}:\n{text}"


def check_plist(job: dict[str, Any]) -> None:
    assert set(job) >= LAUNCHD_KEYS, LAUNCHD_KEYS - set(job)
    assert job["Label"] == "com.lmspd" and job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}  # restarted after a crash, like Restart=on-failure
    assert job["ProgramArguments"][1:] == ["serve"]
    assert {"LMSPD_DATA_DIR", "LMSPD_CACHE_DIR"} <= set(job["EnvironmentVariables"])
    assert job["ExitTimeOut"] > load_config(environ={}).server.shutdown_grace_secs


def test_launchd_plists(fake_install: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    shipped = plistlib.loads((DEPLOY / "com.lmspd.plist").read_bytes())
    check_plist(shipped)
    assert shipped["UserName"] == "lmspd" and shipped["ProgramArguments"][0] == str(EXAMPLE_EXECUTABLE)

    assert main(["service", "print", "--launchd", "--user", "--cache-dir", "/Volumes/models"]) == 0
    agent = plistlib.loads(capsysbinary.readouterr().out)
    check_plist(agent)
    assert "UserName" not in agent and agent["ProgramArguments"][0] == str(fake_install)
    assert agent["EnvironmentVariables"]["LMSPD_CACHE_DIR"] == "/Volumes/models"
    assert agent["StandardErrorPath"] == str(Path.home() / "Library" / "Logs" / "lmspd.log")

    daemon = plistlib.loads(launchd_plist(install_for(load_config(environ={}), launchd=True, user=False)))
    check_plist(daemon)
    assert daemon["UserName"] and daemon["StandardOutPath"] == "/Library/Logs/lmspd.log"


def receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.setblocking(False)
    return sock


def drain(sock: socket.socket) -> list[str]:
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return messages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract unix sockets are Linux's")
def test_notify_addresses(tmp_path: Path) -> None:
    name = f"lmspd-test-{uuid.uuid4().hex}"
    with receiver("\0" + name) as sock:
        assert notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert drain(sock) == ["READY=1"]
    assert not notify("READY=1", {})
    assert not notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})  # logged, not raised


@pytest.fixture
def notify_socket() -> Iterator[tuple[str, socket.socket]]:
    """A bound datagram socket standing in for systemd's (a short path: AF_UNIX allows ~100 bytes)."""
    with tempfile.TemporaryDirectory(prefix="lmspd-") as tmp:
        path = os.path.join(tmp, "notify")
        with receiver(path) as sock:
            yield path, sock


def test_ready_only_once_ready_and_stopping_on_sigterm(
    tmp_path: Path, model_cache: Path, tiny: ResolvedModel, notify_socket: tuple[str, socket.socket]
) -> None:
    path, sock = notify_socket
    with tiny_server(tmp_path, model_cache, tiny) as srv, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as marker:
        marker.connect(path)
        srv.proc = subprocess.Popen(
            [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(srv.config), "--port", str(srv.port)],
            stdout=srv.log.open("ab"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "NOTIFY_SOCKET": path},
        )
        # Before each look at /readyz the test drops a numbered marker into the same socket, which
        # keeps order. Readiness only grows while starting, so a marker followed by a not-ready
        # answer must come before READY=1: one after it would mean READY=1 came before readiness.
        messages: list[str] = []
        not_ready: list[str] = []

        def probe() -> bool:
            """One marker, one look at /readyz; whether READY=1 has come."""
            assert srv.proc is not None and srv.proc.poll() is None, srv.log.read_text()
            marker_text = f"test: probe {len(messages)}-{len(not_ready)}-{time.monotonic()}"
            marker.send(marker_text.encode())
            try:
                ready = httpx.get(f"{srv.url}/readyz", timeout=5).status_code == 200
            except httpx.TransportError:
                ready = False
            if not ready:
                not_ready.append(marker_text)
            messages.extend(drain(sock))
            return any(m.startswith("READY=1") for m in messages)

        wait_until(probe, lambda: srv.log.read_text(), timeout=120)
        ready_at = next(i for i, m in enumerate(messages) if m.startswith("READY=1"))
        assert not_ready, "the test never saw the server starting"
        assert set(not_ready) <= set(messages[:ready_at]), (not_ready, messages)
        assert messages[ready_at] == f"READY=1\nSTATUS=serving on 127.0.0.1:{srv.port}"
        assert httpx.get(f"{srv.url}/readyz", timeout=5).status_code == 200

        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log.read_text()
        assert drain(sock) == ["STOPPING=1"]  # once, after READY=1, and nothing else


def test_never_ready_while_the_default_model_cannot_load(
    tmp_path: Path, model_cache: Path, tiny: ResolvedModel, notify_socket: tuple[str, socket.socket]
) -> None:
    """[engine] max_memory_bytes below the default model's estimate (the tiny model needs about
    3.5 MB): the server comes up and serves, /readyz answers 503 naming why, and systemd hears that
    reason as its STATUS, never READY=1 (docs/operations.md, "Readiness")."""
    path, sock = notify_socket
    with tiny_server(tmp_path, model_cache, tiny, engine="max_memory_bytes = 1000000\n") as srv:
        srv.proc = subprocess.Popen(
            [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(srv.config), "--port", str(srv.port)],
            stdout=srv.log.open("ab"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "NOTIFY_SOCKET": path},
        )

        def answer() -> httpx.Response | None:
            """/readyz's first answer: nothing listens before the app's start (preload) is done."""
            assert srv.proc is not None and srv.proc.poll() is None, srv.log.read_text()
            try:
                return httpx.get(f"{srv.url}/readyz", timeout=5)
            except httpx.TransportError:
                return None

        r = wait_until(answer, lambda: srv.log.read_text(), timeout=120)
        assert r.status_code == 503, r.text
        reason = r.json()["reason"]
        assert "default model" in reason and "'tiny'" in reason and "1000000" in reason, reason
        assert httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200

        messages: list[str] = []

        def told() -> bool:
            messages.extend(drain(sock))
            return any(m.startswith("STATUS=not ready") for m in messages)

        wait_until(told, lambda: f"the probe to say why: {messages} {srv.log.read_text()}", timeout=60)
        assert messages == [f"STATUS=not ready: {reason}"]  # nothing else, READY=1 least of all
        assert "not ready, READY=1 withheld" in srv.log.read_text()

        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.log.read_text()
        assert drain(sock) == ["STOPPING=1"]
