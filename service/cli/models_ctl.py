"""``lmspd models ps|load|unload|pin|unpin`` and ``lmspd engine recycle``: a running server's
models and engine, and their control (all but ``ps`` need an operator token,
``[server] admin_tokens``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from lmspd.cli.tasks import _print_json, _run


def _connection() -> argparse.ArgumentParser:
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--url", help="the server (env LMSPD_URL, default http://127.0.0.1:8080)")
    conn.add_argument("--token", help="bearer token (env LMSPD_TOKEN); an operator's to control")
    return conn


def add_engine_parser(sub: Any) -> Any:
    """Add ``lmspd engine recycle``; the ``engine`` subcommands (``join`` is main's)."""
    engine = sub.add_parser("engine", help="a running server's engine, or this host's rank in a group").add_subparsers(
        dest="engine_command", required=True
    )
    engine.add_parser("recycle", parents=[_connection()], help="replace the engine while serving (no task fails)")
    return engine


def add_parsers(models: Any) -> None:
    """Add the server-side commands to ``lmspd models``' subcommands."""
    conn = _connection()
    ps = models.add_parser("ps", parents=[conn], help="a running server's models: loaded, size, unload due")
    ps.add_argument("--json", action="store_true", help="print the server's JSON")
    for action, help_text in (
        ("load", "load a model on the running server now"),
        ("unload", "unload a model from the running server now"),
        ("pin", "keep a model loaded however long it is idle"),
        ("unpin", "let a pinned model's keep-alive apply again"),
    ):
        cmd = models.add_parser(action, parents=[conn], help=help_text)
        cmd.add_argument("name")
        if action == "unload":
            cmd.add_argument("--force", action="store_true", help="cancel the tasks running on it")


def _size(n: int) -> str:
    return f"{n / 1024**2:.1f} MiB" if n else "-"


def _at(ts: int | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, tz=UTC).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def row(m: dict[str, Any]) -> str:
    state = "loaded" if m.get("loaded") else ("ready" if m.get("ready") else "not pulled")
    unload = "pinned" if m.get("pinned") else _at(m.get("unload_at"))
    return "\t".join(
        (
            m["id"],
            state,
            _size(int(m.get("resident_bytes") or 0)),
            m.get("weight_dtype") or "-",
            m.get("numerics") or "-",
            str(m.get("running", 0)),
            _at(m.get("last_used_at")),
            unload,
        )
    )


def cmd_ps(args: argparse.Namespace) -> int:
    def body(client: Any) -> int:
        listed = client.models()["data"]
        if args.json:
            _print_json(listed)
            return 0
        print("MODEL\tSTATE\tRESIDENT\tDTYPE\tNUMERICS\tRUNNING\tLAST USED\tUNLOAD AT")
        for m in listed:
            print(row(m))
        return 0

    return _run(args, body)


def _control(action: str) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        def body(client: Any) -> int:
            print(row(client.control_model(args.name, action, force=getattr(args, "force", False))))
            return 0

        return _run(args, body)

    return command


def cmd_recycle(args: argparse.Namespace) -> int:
    def body(client: Any) -> int:
        started = client.recycle_engine()["started"]
        print("recycling the engine" if started else "a recycle is already under way")
        return 0

    return _run(args, body)


COMMANDS: dict[tuple[str, str | None], Callable[[argparse.Namespace], int]] = {
    ("engine", "recycle"): cmd_recycle,
    ("models", "ps"): cmd_ps,
    **{("models", action): _control(action) for action in ("load", "unload", "pin", "unpin")},
}
