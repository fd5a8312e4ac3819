"""``lmspd doctor``: what a person runs first when something is wrong.

Each check prints one line, ``ok``, ``warn`` or ``FAIL``, and the command exits 1 when any
check failed. Nothing here changes anything: the database is opened read-only (never
created, never migrated), the port is only bound for a moment, and MLX is imported in a
child process, so a broken MLX install is reported instead of taking the doctor down.
"""

from __future__ import annotations

import errno
import http.client
import json
import shutil
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO

from lmspd import __version__
from lmspd.config import Config
from lmspd.errors import LmspdError
from lmspd.store.url import StoreUrl

Level = Literal["ok", "warn", "FAIL"]
MIN_FREE_BYTES = 256 * 2**20  # below this, SQLite commits and model pulls start failing
LOW_FREE_BYTES = 2 * 2**30
MLX_TIMEOUT_SECS = 60.0
_MLX_PROBE = """
import json, mlx.core as mx
info = {"version": mx.__version__, "device": str(mx.default_device()), "metal": bool(mx.metal.is_available())}
cuda = getattr(mx, "cuda", None)
info["cuda"] = bool(cuda is not None and cuda.is_available())
if info["metal"]:
    device_info = getattr(mx, "device_info", None) or mx.metal.device_info
    info["device_name"] = str(device_info().get("device_name", ""))
print(json.dumps(info))
"""


_REPAIR = (
    "lmspd serve refuses this file and never changes it: stop lmspd, move the file aside with its -wal "
    "and -shm files (sqlite3's .recover may save its rows), and start again, or upgrade lmspd if it is newer"
)


@dataclass(frozen=True)
class Finding:
    level: Level
    check: str
    detail: str


def _lmspd_version() -> Finding:
    return Finding("ok", "version", f"lmspd {__version__}, Python {sys.version.split()[0]}, {sys.executable}")


def _mlx() -> Finding:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _MLX_PROBE], capture_output=True, text=True, timeout=MLX_TIMEOUT_SECS, check=False
        )
    except subprocess.TimeoutExpired:
        return Finding("FAIL", "mlx", f"importing mlx took over {MLX_TIMEOUT_SECS:.0f}s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return Finding("FAIL", "mlx", f"cannot import mlx: {last}")
    info = json.loads(done.stdout)
    backend = "metal" if info["metal"] else "cuda" if info["cuda"] else "cpu"
    name = f" ({info['device_name']})" if info.get("device_name") else ""
    return Finding("ok", "mlx", f"mlx {info['version']}, backend {backend}, device {info['device']}{name}")


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _data_dir(config: Config) -> Finding:
    data = config.server.database_path.parent
    free = shutil.disk_usage(_existing(data)).free
    where = f"{data}: {_gib(free)} free"
    if not data.exists():
        where += " (not created yet: lmspd serve creates it)"
    if free < MIN_FREE_BYTES:
        return Finding("FAIL", "data dir", where)
    return Finding("warn" if free < LOW_FREE_BYTES else "ok", "data dir", where)


# Leases are measured on the database's clock; a node this far off it logs misleading times.
SKEW_WARN_SECS = 2.0


def _postgres(store: StoreUrl) -> list[Finding]:
    from lmspd.store.pg import inspect

    try:
        found = inspect(store)
    except LmspdError as exc:
        return [Finding("FAIL", "database", exc.message)]
    where = Finding("ok", "database", f"{store} (PostgreSQL {found.server_version})")
    if found.schema > found.latest:
        schema = Finding(
            "FAIL", "schema", f"version {found.schema}, newer than this lmspd ({found.latest}): upgrade lmspd"
        )
    elif found.schema < found.latest:
        schema = Finding("ok", "schema", f"version {found.schema} of {found.latest} (migrated on the next start)")
    else:
        schema = Finding("ok", "schema", f"version {found.schema} of {found.latest}")
    skew = abs(found.skew_secs)
    clock = Finding(
        "warn" if skew > SKEW_WARN_SECS else "ok",
        "clock",
        f"{found.skew_secs:+.2f}s from the database's (leases use the database's clock)",
    )
    nodes = Finding(
        "ok", "nodes", f"{found.nodes} nodes, {found.expired} with an expired lease (a survivor settles them)"
    )
    return [where, schema, clock, nodes]


def _database(config: Config) -> list[Finding]:
    from lmspd.store.check import problem
    from lmspd.store.migrate import migrations

    store = StoreUrl.parse(config.store.url, config.server.database_path)
    if store.dialect == "postgresql":
        return _postgres(store)
    path = store.path or config.server.database_path
    try:
        latest = len(migrations())
    except LmspdError as exc:
        return [Finding("FAIL", "database", exc.message)]
    if latest == 0:
        return [Finding("FAIL", "database", "this lmspd found no migrations: it cannot create its database")]
    if not path.exists():
        return [Finding("ok", "database", f"{path} does not exist yet (created at schema {latest} on first start)")]
    cause = problem(path)  # what lmspd serve would refuse the file for
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
        try:
            current = conn.execute("PRAGMA user_version").fetchone()[0]
            integrity = [row[0] for row in conn.execute("PRAGMA integrity_check")]
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return [Finding("FAIL", "database", f"{path}: {cause or exc}"), Finding("FAIL", "database", _REPAIR)]
    if cause is not None and current <= latest:
        return [Finding("FAIL", "database", f"{path}: {cause}"), Finding("FAIL", "database", _REPAIR)]
    if current > latest:
        schema = Finding("FAIL", "schema", f"version {current}, newer than this lmspd ({latest}): upgrade lmspd")
    elif current < latest:
        schema = Finding("ok", "schema", f"version {current} of {latest} (migrated on the next start)")
    else:
        schema = Finding("ok", "schema", f"version {current} of {latest}")
    ok = integrity == ["ok"]
    checked = Finding("ok" if ok else "FAIL", "integrity", "ok" if ok else "; ".join(integrity[:5]))
    return [Finding("ok", "database", str(path)), schema, checked]


def _models(config: Config) -> list[Finding]:
    from lmspd.models.registry import ModelRegistry

    infos = ModelRegistry(config).list()
    found = [Finding("ok", "models", f"cache {config.model_cache_dir}")]
    for info in infos:
        default = " (default)" if info.name == config.default_model else ""
        state = f"ready at {info.path}" if info.pulled else "not pulled"
        found.append(Finding("ok", "model", f"{info.name}{default}: {state}"))
    if not any(info.name == config.default_model and info.pulled for info in infos):
        found.append(
            Finding("warn", "models", f"the default model {config.default_model} is not cached: lmspd serve fetches it")
        )
    return found


def _lmspd_answers(host: str, port: int) -> bool:
    conn = http.client.HTTPConnection(host if ":" not in host else f"[{host}]", port, timeout=2)
    try:
        conn.request("GET", "/lmsp/v1/healthz")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _port(config: Config) -> Finding:
    from lmspd.cli.serve import check_bind

    host, port = config.server.host, config.server.port
    where = f"{host}:{port}"
    try:
        check_bind(config)
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except LmspdError as exc:
        return Finding("FAIL", "port", exc.message)
    except OSError as exc:
        return Finding("FAIL", "port", f"{where}: cannot resolve {host}: {exc}")
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return Finding("FAIL", "port", f"{where}: cannot bind: {exc.strerror}")
        else:
            return Finding("ok", "port", f"{where} is free")
    probe = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    if _lmspd_answers(probe, port):
        return Finding("ok", "port", f"{where} is in use by a running lmspd (healthz answers)")
    return Finding("FAIL", "port", f"{where} is in use by another program")


def _readyz(host: str, port: int) -> tuple[int, str] | None:
    """A running server's /readyz: its status and its reason ("" when ready); None: none answers."""
    conn = http.client.HTTPConnection(host if ":" not in host else f"[{host}]", port, timeout=2)
    try:
        conn.request("GET", "/readyz")
        r = conn.getresponse()
        body = json.loads(r.read() or b"{}")
        return r.status, str(body.get("reason") or "")
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


def _group(config: Config) -> Finding:
    """The engine's group of hosts (docs/distributed.md): each resolves, and, where this host's
    server runs, whether the group has formed or which host it waits for."""
    hosts = config.engine.hosts
    if not hosts:
        return Finding("ok", "group", "one process (no [engine] hosts)")
    from lmspd.engine.group.ring import endpoint

    try:
        ring = [endpoint(h) for h in hosts]
    except LmspdError as exc:
        return Finding("FAIL", "group", exc.message)
    named = ", ".join(f"rank {r} {e}" for r, e in enumerate(ring))
    host = config.server.host
    probe = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    answer = _readyz(probe, config.server.port)
    if answer is None:
        return Finding("ok", "group", f"{named} (this host's server is not running)")
    status, reason = answer
    if status == 200 and reason:
        return Finding("warn", "group", f"{named}: {reason}")
    if status == 200:
        return Finding("ok", "group", f"{named}: formed, the server is ready")
    if "rank" in reason:
        return Finding("FAIL", "group", f"{named}: {reason}")
    return Finding("warn", "group", f"{named}: the server is not ready: {reason}")


def _blas(config: Config) -> Finding:
    from lmspd.engine.upstream import blas

    if not sys.platform.startswith("linux"):
        return Finding("ok", "blas", "MLX's own (Metal or Accelerate)")
    path = blas.find(config.engine.blas)
    if path is None:
        how = "engine.blas = 'none'" if config.engine.blas == blas.NONE else "no OpenBLAS found"
        return Finding(
            "warn",
            "blas",
            f"reference BLAS bundled with mlx ({how}): prefill runs ~30x slower than it could; "
            "apt install libopenblas0-pthread",
        )
    if not Path(path).is_file() and "/" in path:
        return Finding("FAIL", "blas", f"engine.blas names {path}, which does not exist")
    return Finding("ok", "blas", f"{path}; weight_dtype {config.engine.weight_dtype} is measured with it")


def _kernels(config: Config) -> Finding:
    from lmspd.engine import kernels

    dtype = config.engine.weight_dtype
    if dtype not in ("auto", "quantized_float32"):
        return Finding("ok", "kernels", f"not used (weight_dtype {dtype})")
    root = kernels.cache_root(config.engine.kernel_dir)
    if (path := kernels.built(root)) is not None:
        return Finding("ok", "kernels", f"built at {path.parent}: quantized models run packed in float32")
    try:
        kernels.preflight()
    except kernels.KernelUnavailable as exc:
        if dtype == "quantized_float32":
            return Finding("FAIL", "kernels", f"weight_dtype quantized_float32 needs them: {exc}")
        if not sys.platform.startswith("linux"):
            return Finding("ok", "kernels", "not needed (MLX's own quantized kernels)")
        return Finding("warn", "kernels", f"{exc}: quantized models run dense (about 5x the memory)")
    return Finding("ok", "kernels", f"built on the first model load (about 10 s) into {root}")


def _numerics(config: Config) -> Finding:
    """Which products the models run (docs/numerics.md): the exact path or the fast one."""
    from lmspd.engine import kernels
    from lmspd.engine.weights import AUTO_FAST_BYTES, resolve_numerics

    setting, dtype = config.engine.numerics, config.engine.weight_dtype
    if dtype not in ("auto", "quantized_float32"):
        return Finding("ok", "numerics", f"exact: MLX's own products (weight_dtype {dtype})")
    path = kernels.built(kernels.cache_root(config.engine.kernel_dir))
    if path is None:
        return Finding("ok", "numerics", f"{setting}: settled when the kernels are built (the first model load)")
    fast_simd = kernels.load_path(path).q8_simd()
    if setting == "auto":
        return Finding(
            "ok",
            "numerics",
            f"auto: exact (MLX's own bits) for models under {AUTO_FAST_BYTES >> 20} MiB of weights, "
            f"fast (8-bit activations, {fast_simd}) from there on; each model's on the models list",
        )
    if resolve_numerics(setting, 0) == "fast":
        return Finding("ok", "numerics", f"fast: 8-bit activations in 4-bit weights' products ({fast_simd})")
    return Finding("ok", "numerics", f"exact: MLX's own bits (numerics {setting}; fast path's kernel {fast_simd})")


def run(config: Config, out: TextIO | None = None) -> int:
    """Print every finding (to stdout by default); 1 when any failed, else 0."""
    out = out or sys.stdout
    checks: list[Callable[[Config], Finding | list[Finding]]] = [
        lambda _: _lmspd_version(),
        lambda _: _mlx(),
        _blas,
        _kernels,
        _numerics,
        _data_dir,
        _database,
        _models,
        _port,
        _group,
    ]
    failed = False
    for check in checks:
        try:
            found = check(config)
        except Exception as exc:  # a check that breaks is a finding, not a traceback
            found = Finding("FAIL", getattr(check, "__name__", "check").strip("_"), f"{type(exc).__name__}: {exc}")
        for finding in found if isinstance(found, list) else [found]:
            failed |= finding.level == "FAIL"
            print(f"{finding.level:<4}  {finding.check:<9}  {finding.detail}", file=out, flush=True)
    return 1 if failed else 0
