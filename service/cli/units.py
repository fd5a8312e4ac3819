"""``lmspd service print``: a systemd unit or a launchd plist for this install's paths.

The shipped ``deploy/lmspd.service`` and ``deploy/com.lmspd.plist`` are these renderings for an
install in ``/opt/lmspd`` (``python -m lmspd.cli.units`` rewrites them; a test keeps them equal).

System variants run as a dedicated user with their own state and cache directories; ``--user``
variants (a systemd user unit, a launchd LaunchAgent) run as you, on your configured directories.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import math
import os
import plistlib
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lmspd.config import Config, load_config
from lmspd.errors import ConfigError

LABEL = "com.lmspd"
SERVICE_USER = "lmspd"
# Where a system unit keeps its database and models unless configured otherwise: systemd's
# StateDirectory= and CacheDirectory= create them, owned by the service user.
SYSTEM_DATA_DIR = Path("/var/lib/lmspd")
SYSTEM_CACHE_DIR = Path("/var/cache/lmspd")
# Past server.shutdown_grace_secs, the rest of a clean stop: the lifespan's close (tasks left
# recoverable, the engine process stopped, the database closed) before SIGKILL.
STOP_MARGIN_SECS = 20
# Open files (SSE streams are sockets): launchd's default is 256, systemd's 1024.
MAX_OPEN_FILES = 8192
HOME_DIRS = (Path("/home"), Path("/root"), Path("/run/user"))


@dataclass(frozen=True)
class Install:
    """What a unit needs to know about an install."""

    executable: Path
    data_dir: Path
    cache_dir: Path
    stop_timeout_secs: int
    user: bool  # a user unit / LaunchAgent, else a system unit / LaunchDaemon
    run_as: str | None = None  # the account a system unit runs as
    config: Path | None = None
    log_path: Path | None = None  # launchd's stdout and stderr
    join_rank: int | None = None  # a host of an engine group: `lmspd engine join --rank N`, not serve


def _command(install: Install) -> list[str]:
    if install.join_rank is None:
        return ["serve"]
    return ["engine", "join", "--rank", str(install.join_rank)]


def stop_timeout(shutdown_grace_secs: float) -> int:
    return math.ceil(shutdown_grace_secs) + STOP_MARGIN_SECS


def find_executable() -> Path:
    """The ``lmspd`` console script of this install: next to the running Python (a venv), else on PATH."""
    beside = Path(sys.executable).parent / "lmspd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside.absolute()
    found = shutil.which("lmspd")
    if found is None:
        raise ConfigError("cannot find the lmspd executable next to this Python or on PATH; install lmspd first")
    return Path(found).absolute()


def _abs(path: Path | str) -> Path:
    return Path(path).expanduser().absolute()


def install_for(
    config: Config,
    *,
    launchd: bool,
    user: bool,
    config_path: Path | None = None,
    executable: Path | None = None,
    home: Path | None = None,
) -> Install:
    """This install, as ``config`` (data and cache dirs, shutdown grace) and the flags describe it."""
    home = home or Path.home()
    data_dir = _abs(config.server.data_dir) if config.server.data_dir else None
    cache_dir = _abs(config.cache_dir) if config.cache_dir else None
    if not user and not launchd:  # a dedicated account: its own directories unless configured
        data_dir, cache_dir = data_dir or SYSTEM_DATA_DIR, cache_dir or SYSTEM_CACHE_DIR
    # A LaunchDaemon runs as you (at boot, before any login): macOS makes no account in one command.
    run_as = None if user else getpass.getuser() if launchd else SERVICE_USER
    log_path = None
    if launchd:
        log_path = home / "Library" / "Logs" / "lmspd.log" if user else Path("/Library/Logs/lmspd.log")
    return Install(
        executable=executable or find_executable(),
        data_dir=data_dir or _abs(config.server.database_path.parent),
        cache_dir=cache_dir or _abs(config.model_cache_dir),
        stop_timeout_secs=stop_timeout(config.server.shutdown_grace_secs),
        user=user,
        run_as=run_as,
        config=_abs(config_path) if config_path else None,
        log_path=log_path,
    )


def environment(install: Install) -> dict[str, str]:
    env = {"LMSPD_DATA_DIR": str(install.data_dir), "LMSPD_CACHE_DIR": str(install.cache_dir)}
    if install.config:
        env["LMSPD_CONFIG"] = str(install.config)
    return env


def _quote(value: str, *, exec_line: bool = False) -> str:
    """One word of a unit file: specifiers (``%``) escaped, ``$`` too on Exec lines, quoted if needed."""
    if "\n" in value:
        raise ConfigError(f"a path in a unit file cannot contain a newline: {value!r}")
    value = value.replace("%", "%%")
    if exec_line:
        value = value.replace("$", "$$")
    if any(c in value for c in " \t\"'\\;"):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def _under(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


_SERVE_STOP = [
    "# SIGTERM to lmspd alone: it stops intake, ends event streams within server.shutdown_grace_secs,",
    "# leaves running tasks recoverable and stops its engine process itself; SIGKILL only past the timeout.",
]
_JOIN_STOP = ["# SIGTERM to the join: it stops its rank process (rank 0's engine sees the host go)."]


def systemd_unit(install: Install) -> str:
    env = environment(install)
    system = not install.user
    if system:  # models fetched from Hugging Face go to the cache dir, not a home the user may lack
        env["HF_HOME"] = str(install.cache_dir / "huggingface")
    name = "lmspd-join.service" if install.join_rank is not None else "lmspd.service"
    kind = f"user unit (~/.config/systemd/user/{name})" if install.user else "system unit"
    flags = (" --user" if install.user else "") + (
        f" --join {install.join_rank}" if install.join_rank is not None else ""
    )
    lines = [
        f"# lmspd, a local MLX model server, as a systemd {kind}.",
        f"# Written by `lmspd service print --systemd{flags}`.",
        "[Unit]",
    ]
    if install.join_rank is None:
        lines += [
            "Description=lmspd local MLX model server",
            *(["After=network-online.target", "Wants=network-online.target"] if system else []),
            "",
            "[Service]",
            "# READY=1 comes once unfinished tasks are recovered and the default model is loaded",
            "# (a first start may download it: pull it beforehand with `lmspd models pull`).",
            "Type=notify",
            "TimeoutStartSec=15min",
        ]
    else:
        lines += [
            f"Description=lmspd engine group, rank {install.join_rank} ([engine] hosts: docs/distributed.md)",
            *(["After=network-online.target", "Wants=network-online.target"] if system else []),
            "",
            "[Service]",
            "# It joins the group of the server named first in [engine] hosts, again each time it forms.",
            "Type=simple",
        ]
    if system:
        lines += [f"User={install.run_as}", f"Group={install.run_as}"]
    lines += [
        f"ExecStart={_quote(str(install.executable), exec_line=True)} {' '.join(_command(install))}",
        *(f"Environment={_quote(f'{k}={v}')}" for k, v in env.items()),
        "Restart=on-failure",
        "RestartSec=2s",
        *(_SERVE_STOP if install.join_rank is None else _JOIN_STOP),
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        f"TimeoutStopSec={install.stop_timeout_secs}",
        f"LimitNOFILE={MAX_OPEN_FILES}",
        "UMask=0027",
        "NoNewPrivileges=yes",
    ]
    if system:
        paths = [install.data_dir, install.cache_dir, install.executable, *([install.config] if install.config else [])]
        in_home = any(_under(p, h) for p in paths for h in HOME_DIRS)
        for key, base, path in (
            ("StateDirectory", Path("/var/lib"), install.data_dir),
            ("CacheDirectory", Path("/var/cache"), install.cache_dir),
        ):
            if _under(path, base) and path != base:
                lines.append(f"{key}={_quote(str(path.relative_to(base)))}")
        lines += [
            "ProtectSystem=strict",
            f"ReadWritePaths={_quote(str(install.data_dir))} {_quote(str(install.cache_dir))}",
            "PrivateTmp=yes",
            # an install or a directory under /home: readable, and the data dirs writable above
            f"ProtectHome={'read-only' if in_home else 'yes'}",
            "ProtectKernelTunables=yes",
            "ProtectKernelModules=yes",
            "ProtectControlGroups=yes",
            "RestrictSUIDSGID=yes",
            "LockPersonality=yes",
        ]
    else:
        lines.append("# (the sandboxing options of a system unit need user namespaces in a user unit: left out)")
    lines += ["", "[Install]", f"WantedBy={'default.target' if install.user else 'multi-user.target'}", ""]
    return "\n".join(lines)


def launchd_plist(install: Install) -> bytes:
    assert install.log_path is not None
    job: dict[str, object] = {
        "Label": LABEL if install.join_rank is None else f"{LABEL}.join",
        "ProgramArguments": [str(install.executable), *_command(install)],
        "EnvironmentVariables": environment(install),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restarted unless it stopped cleanly (on-failure)
        "ExitTimeOut": install.stop_timeout_secs,  # SIGTERM, then SIGKILL after this
        "ProcessType": "Interactive",  # not throttled like a background job
        "SoftResourceLimits": {"NumberOfFiles": MAX_OPEN_FILES},
        "StandardOutPath": str(install.log_path),
        "StandardErrorPath": str(install.log_path),
    }
    if install.run_as:
        job["UserName"] = install.run_as
    return plistlib.dumps(job)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: Callable[..., None]) -> None:
    service = sub.add_parser("service", help="run lmspd as a system service")
    commands = service.add_subparsers(dest="service_command", required=True)
    printer = commands.add_parser("print", help="write a systemd unit or launchd plist for this install")
    kind = printer.add_mutually_exclusive_group(required=True)
    kind.add_argument("--systemd", action="store_true", help="a systemd unit (Linux)")
    kind.add_argument("--launchd", action="store_true", help="a launchd plist (macOS)")
    printer.add_argument(
        "--user", action="store_true", help="a user unit / LaunchAgent (default: a system unit / LaunchDaemon)"
    )
    printer.add_argument("--data-dir", help="where the SQLite database lives (env LMSPD_DATA_DIR)")
    printer.add_argument(
        "--join",
        type=int,
        metavar="RANK",
        help="a host of an engine group: `lmspd engine join --rank RANK` (docs/distributed.md)",
    )
    common(printer)


def cmd_print(args: argparse.Namespace, config: Config) -> int:
    config_path = args.config or (Path(os.environ["LMSPD_CONFIG"]) if os.environ.get("LMSPD_CONFIG") else None)
    install = install_for(config, launchd=args.launchd, user=args.user, config_path=config_path)
    if args.join is not None:
        hosts = config.engine.hosts
        if not hosts:
            raise ConfigError("--join: [engine] hosts names no group (docs/distributed.md)", param="engine.hosts")
        if not 0 < args.join < len(hosts):
            raise ConfigError(f"--join {args.join}: the ranks that join are 1..{len(hosts) - 1}", param="engine.hosts")
        install = dataclasses.replace(install, join_rank=args.join)
    if args.launchd:
        sys.stdout.buffer.write(launchd_plist(install))
    else:
        sys.stdout.write(systemd_unit(install))
    sys.stdout.flush()
    return 0


EXAMPLE_EXECUTABLE = Path("/opt/lmspd/bin/lmspd")


def examples() -> dict[str, bytes]:
    """The shipped ``deploy/`` files: the system variants for an install in /opt/lmspd."""
    config = load_config(environ={})
    systemd = install_for(config, launchd=False, user=False, executable=EXAMPLE_EXECUTABLE)
    launchd = Install(
        executable=EXAMPLE_EXECUTABLE,
        data_dir=Path("/usr/local/var/lmspd"),
        cache_dir=Path("/usr/local/var/cache/lmspd"),
        stop_timeout_secs=systemd.stop_timeout_secs,
        user=False,
        run_as=SERVICE_USER,
        log_path=Path("/Library/Logs/lmspd.log"),
    )
    return {"lmspd.service": systemd_unit(systemd).encode(), f"{LABEL}.plist": launchd_plist(launchd)}


if __name__ == "__main__":
    deploy = Path(__file__).resolve().parent.parent / "deploy"
    deploy.mkdir(exist_ok=True)
    for name, content in examples().items():
        (deploy / name).write_bytes(content)
