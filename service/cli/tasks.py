"""``lmspd tasks submit|watch|list|get|cancel``: the LMSP task API from the command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"
STATUSES = ("queued", "loading", "running", "cancelling", "succeeded", "failed", "cancelled")


def add_parser(sub: Any) -> None:
    """Add ``tasks`` and its commands to the ``lmspd`` parser's subcommands."""
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--url", help=f"the server (env LMSPD_URL, default {DEFAULT_URL})")
    conn.add_argument("--token", help="bearer token (env LMSPD_TOKEN)")

    tasks = sub.add_parser("tasks", help="submit, watch and manage tasks on a running server")
    cmds = tasks.add_subparsers(dest="tasks_command", required=True)

    submit = cmds.add_parser("submit", parents=[conn], help="create a task that answers PROMPT")
    submit.add_argument("prompt")
    submit.add_argument("--model", help="model alias or name (default: the server's)")
    submit.add_argument("--max-output-tokens", type=int)
    submit.add_argument("--temperature", type=float)
    submit.add_argument("--instructions", help="system prompt")
    submit.add_argument(
        "--on-restart", choices=["fail", "retry", "resume"], help="what a server restart does to it (default fail)"
    )
    submit.add_argument("--idempotency-key", help="submitting again with the same key gives the same task")
    submit.add_argument("--watch", action="store_true", help="then follow it as `tasks watch` does")

    watch = cmds.add_parser("watch", parents=[conn], help="follow a task's output live, across restarts")
    watch.add_argument("task_id")
    watch.add_argument("--after", type=int, help="start after this event sequence number (default: the start)")

    listing = cmds.add_parser("list", parents=[conn], help="tasks, newest first")
    listing.add_argument("--status", action="append", choices=STATUSES, help="only these statuses (repeatable)")
    listing.add_argument("--limit", type=int, help="at most this many (1-100, default 20)")
    listing.add_argument("--after", help="the page after this task id")
    listing.add_argument("--json", action="store_true", help="print the server's JSON")

    get = cmds.add_parser("get", parents=[conn], help="a task as JSON")
    get.add_argument("task_id")
    get.add_argument("--text", action="store_true", help="only the output text of a succeeded task")

    cancel = cmds.add_parser("cancel", parents=[conn], help="cancel a task (idempotent)")
    cancel.add_argument("task_id")


def _run(args: argparse.Namespace, body: Callable[[Any], int]) -> int:
    from lmspd.client.http import ClientError, TaskClient

    url = args.url or os.environ.get("LMSPD_URL") or DEFAULT_URL
    token = args.token or os.environ.get("LMSPD_TOKEN") or None
    try:
        with TaskClient(url, token, transport=getattr(args, "transport", None)) as client:
            return body(client)
    except ClientError as exc:
        print(f"lmspd: error: {exc.message}", file=sys.stderr, flush=True)
        return 1


def cmd_submit(args: argparse.Namespace) -> int:
    def body(client: Any) -> int:
        task = client.submit(
            args.prompt,
            model=args.model,
            max_output_tokens=args.max_output_tokens,
            temperature=args.temperature,
            instructions=args.instructions,
            on_restart=args.on_restart,
            idempotency_key=args.idempotency_key,
        )
        if not args.watch:
            print(task["id"], flush=True)
            return 0
        status = f"lmspd: task {task['id']} {task['status']} (on_restart {task['on_restart']})"
        print(status, file=sys.stderr, flush=True)
        return _watch(client, task["id"], None)

    return _run(args, body)


def cmd_watch(args: argparse.Namespace) -> int:
    return _run(args, lambda client: _watch(client, args.task_id, args.after))


def _watch(client: Any, task_id: str, after: int | None) -> int:
    from lmspd.client.watch import watch

    return watch(client, task_id, out=sys.stdout, err=sys.stderr, after=after)


def cmd_list(args: argparse.Namespace) -> int:
    def body(client: Any) -> int:
        page = client.list(statuses=args.status, limit=args.limit, after=args.after)
        if args.json:
            _print_json(page)
            return 0
        rows = [
            (t["id"], t["status"], t["on_restart"], str(t["attempt"]), _when(t["created_at"])) for t in page["data"]
        ]
        header = ("ID", "STATUS", "ON_RESTART", "ATTEMPT", "CREATED")
        if sys.stdout.isatty():
            from rich.console import Console
            from rich.table import Table

            table = Table(*header, box=None)
            for row in rows:
                table.add_row(*row)
            Console().print(table)
        else:
            for row in rows:
                print("\t".join(row))
        if page.get("has_more"):
            print(f"lmspd: more: --after {page['last_id']}", file=sys.stderr)
        return 0

    return _run(args, body)


def cmd_get(args: argparse.Namespace) -> int:
    def body(client: Any) -> int:
        task = client.get(args.task_id)
        if not args.text:
            _print_json(task)
            return 0
        if task["status"] != "succeeded":
            print(f"lmspd: error: task {task['id']} is {task['status']}, it has no output text", file=sys.stderr)
            return 1
        sys.stdout.write(output_text(task["response"]))
        sys.stdout.flush()
        return 0

    return _run(args, body)


def cmd_cancel(args: argparse.Namespace) -> int:
    def body(client: Any) -> int:
        task = client.cancel(args.task_id)
        print(f"{task['id']} {task['status']}")
        return 0

    return _run(args, body)


def output_text(response: dict[str, Any]) -> str:
    """The text of a response's messages, in order (what ``tasks watch`` prints)."""
    return "".join(
        part.get("text", "")
        for item in response.get("output", [])
        if item.get("type") == "message"
        for part in item.get("content", [])
        if part.get("type") == "output_text"
    )


def _print_json(obj: Any) -> None:
    import msgspec

    print(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode())


def _when(ts: int) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).astimezone().strftime("%Y-%m-%d %H:%M:%S")


COMMANDS: dict[tuple[str, str | None], Callable[[argparse.Namespace], int]] = {
    ("tasks", "submit"): cmd_submit,
    ("tasks", "watch"): cmd_watch,
    ("tasks", "list"): cmd_list,
    ("tasks", "get"): cmd_get,
    ("tasks", "cancel"): cmd_cancel,
}
