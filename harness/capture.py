"""What the two real agent clients' harness modules share (``codex``/``claude`` and their
``*_capture`` stand-in servers): where a pinned npm CLI is, and the capture servers' command
line and event-stream writing."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def pinned_binary(command: str, variable: str, prefix: Path) -> Path | None:
    """A pinned npm CLI: ``$variable`` if set, else the one .ci/run installs under ``prefix``
    (the test cache), else ``command`` on PATH; None when there is none."""
    if env := os.environ.get(variable):
        return Path(env)
    pinned = prefix / "node_modules" / ".bin" / command
    if pinned.exists():
        return pinned
    found = shutil.which(command)
    return Path(found) if found else None


def write_events(out: io.BufferedIOBase, events: Iterable[dict[str, Any]]) -> None:
    """``events`` as a server-sent event stream, each named by its ``type``."""
    for event in events:
        out.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
    out.flush()


def main(
    *,
    port: int,
    handler: Callable[[Path], type[BaseHTTPRequestHandler]],
    scrub: Callable[[str, str, str], str],
    home: str,
) -> None:
    """A capture server's command line: ``serve OUT_DIR [--port N]`` records every request into
    OUT_DIR; ``scrub SRC DST HOME_OPTION DIR --workspace DIR`` writes SRC's request to DST with
    what names the capturing machine replaced (``scrub(text, home, workspace)``)."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve")
    run.add_argument("out", type=Path)
    run.add_argument("--port", type=int, default=port)
    clean = sub.add_parser("scrub")
    clean.add_argument("src", type=Path)
    clean.add_argument("dst", type=Path)
    clean.add_argument(home, dest="home", required=True)
    clean.add_argument("--workspace", required=True)
    args = parser.parse_args()
    if args.command == "scrub":
        entry = json.loads(scrub(args.src.read_text(), args.home, args.workspace))
        args.dst.write_text(json.dumps(entry, indent=1, ensure_ascii=False) + "\n")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), handler(args.out)).serve_forever()
