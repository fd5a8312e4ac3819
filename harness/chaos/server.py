"""The ``lmspd serve`` process of a chaos run: its model, its config, starting it, killing it
(the whole process group, or only its engine) and peeking at its database."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

from harness.server import free_port
from lmspd.config import load_config
from lmspd.models.catalog import BUILTIN_MODELS
from lmspd.models.pull import pull_builtin

ROOT = Path(__file__).resolve().parents[2]
TEST_CACHE = Path(os.environ.get("LMSPD_TEST_CACHE", ROOT / ".test-cache"))
ACTIVE = ("queued", "loading", "running", "cancelling")


def tiny_model(dest: Path) -> Path:
    """The test suite's tiny random-weight llama (real MLX, SmolLM2's tokenizer) with a
    4096-token context, so a generation takes a second or two and a cycle a few seconds."""
    smol = pull_builtin(BUILTIN_MODELS["smollm2-135m-instruct"], TEST_CACHE / "models")
    from harness.models import make_tiny_model  # one definition of the tiny model, the tests'

    return make_tiny_model(dest / "tiny", smol, seed=0, context=4096)


def write_config(
    data: Path, model: str | None, *, store: str | None = None, cluster: str = "", tiny: Path | None = None
) -> Path:
    """A config on ``data``: the tiny model (or ``model``; ``tiny``: the tiny model made
    already), the response store unbounded so nothing acknowledged is evicted during the run,
    SSE keep-alives every second. ``store``: a PostgreSQL URL, with ``cluster``'s lines."""
    if model is None:
        head = f'default_model = "tiny"\ncache_dir = "{TEST_CACHE / "models"}"\n'
        head += '[engine]\nweight_dtype = "quantized"\nmax_concurrency = 4\n'
        tail = f'[models.tiny]\npath = "{tiny or tiny_model(data)}"\n'
    else:
        head = f'default_model = "{model}"\ncache_dir = "{load_config().model_cache_dir}"\n'
        head += "[engine]\nmax_concurrency = 4\n"
        tail = ""
    config = data / "lmspd.toml"
    config.write_text(
        head + f'[server]\ndata_dir = "{data / "data"}"\nkeepalive_secs = 1.0\n'
        "[responses]\nstore_max_entries = 100000000\nstore_max_bytes = 100000000000\nstore_ttl_secs = 0\n"
        "background_max_jobs = 100000\n" + tail + (f'[store]\nurl = "{store}"\n[cluster]\n{cluster}' if store else "")
    )
    return config


class Server:
    def __init__(self, config: Path, data: Path) -> None:
        self.config = config
        self.db = data / "data" / "lmspd.db"
        self.log = data / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def spawn(self) -> None:
        """Start it in its own process group (the server, its engine and their helpers)."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "lmspd.cli", "serve", "--config", str(self.config), "--port", str(port)]
        # Only the config written here: no LMSPD_* variable may point it at a real data directory.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LMSPD_", "LMSP_"))}
        with self.log.open("ab") as log:
            log.write(f"\n===== chaos: {' '.join(cmd)}\n".encode())
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def ready(self, timeout: float = 180) -> None:
        """Wait until /readyz answers 200 (recovery done, the engine up)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmspd serve exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"lmspd serve was not ready within {timeout:.0f}s; see {self.log}")

    def kill9(self) -> None:
        """SIGKILL to the whole process group at once, as a power cut would; returns once
        none of them is left."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):  # all gone already (after a SIGTERM)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the engine, now an orphan, is reaped by init
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.01)

    def terminate(self) -> None:
        """SIGTERM to the server only: a clean shutdown begins."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        """SIGTERM to the server only (it stops its engine): the clean shutdown's exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill9()
            return -9

    def engine_pid(self) -> int | None:
        """The engine process: the server's child started by multiprocessing's spawn."""
        assert self.proc is not None
        found = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "spawn_main"], capture_output=True, text=True)
        pids = found.stdout.split()
        return int(pids[0]) if pids else None

    def count(self, statuses: tuple[str, ...] = ACTIVE) -> int:
        """Tasks in these statuses, read from the database beside the running server."""
        if not self.db.exists():
            return 0
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5)
        try:
            marks = ",".join("?" * len(statuses))
            return int(conn.execute(f"SELECT count(*) FROM tasks WHERE status IN ({marks})", statuses).fetchone()[0])
        finally:
            conn.close()
