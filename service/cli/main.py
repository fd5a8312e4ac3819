"""The ``lmspd`` command: ``models pull|list|ps|load|unload|pin|unpin``, ``generate``, ``serve``,
``tasks ...``, ``service print``, ``openapi`` and ``doctor``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, get_args

from lmspd.cli import models_ctl, units
from lmspd.cli import tasks as tasks_cli
from lmspd.config import RESPONSES_FLAGS, Config, WeightDtype, load_config
from lmspd.errors import LmspdError
from lmspd.logs import ENV as LOG_FORMAT_ENV
from lmspd.logs import FORMATS as LOG_FORMATS
from lmspd.logs import default_format
from lmspd.logs import setup as setup_logging

EXIT_GRACE_SECS = 5.0  # a failed start exits within this, whatever is left running


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (env LMSPD_CONFIG)")
    parser.add_argument("--cache-dir", help="model cache directory (env LMSPD_CACHE_DIR)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmspd", description="Local MLX model server")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage models").add_subparsers(dest="models_command", required=True)
    pull = models.add_parser("pull", help="fetch and convert a built-in model")
    pull.add_argument("name", nargs="?", help="model name (default: the configured default model)")
    _common(pull)
    listing = models.add_parser("list", help="show configured and cached models")
    _common(listing)
    models_ctl.add_parsers(models)
    engine = models_ctl.add_engine_parser(sub)
    join = engine.add_parser("join", help="serve this host's layers in the engine group of [engine] hosts' first")
    join.add_argument("--rank", type=int, default=1, help="this host's place in [engine] hosts (1 is the second)")
    join.add_argument("--log-format", choices=LOG_FORMATS, default=default_format(), help="text, or json")
    _common(join)

    srv = sub.add_parser("serve", help="run the HTTP server")
    srv.add_argument("--host", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="port (default 8080)")
    srv.add_argument("--data-dir", help="where the SQLite database lives (env LMSPD_DATA_DIR)")
    srv.add_argument("--model", help="default model alias or name")
    srv.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=default_format(),
        help=f"text, or json: one object per line for journald/launchd collectors (env {LOG_FORMAT_ENV})",
    )
    for flag, (key, env) in RESPONSES_FLAGS.items():
        srv.add_argument(flag, type=int, dest=f"responses_{key}", help=f"responses.{key} (env {env})")
    _common(srv)

    gen = sub.add_parser("generate", help="stream a reply to PROMPT through the engine")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="model alias, built-in name, directory or Hugging Face repo")
    gen.add_argument("--max-output-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, help="default: the model's own (GET /v1/models shows it)")
    gen.add_argument("--top-p", type=float, help="default: the model's")
    gen.add_argument("--instructions", help="system prompt")
    gen.add_argument("--weight-dtype", choices=get_args(WeightDtype))
    _common(gen)

    units.add_parser(sub, _common)
    sub.add_parser("openapi", help="print the server's OpenAPI 3.1 document (JSON)")
    doctor = sub.add_parser("doctor", help="check the install, data dir, database, models and port")
    doctor.add_argument("--data-dir", help="where the SQLite database lives (env LMSPD_DATA_DIR)")
    doctor.add_argument("--port", type=int, help="port to check (default: the configured one)")
    _common(doctor)
    tasks_cli.add_parser(sub)
    return parser


def _config(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {
        "cache_dir": args.cache_dir,
        "engine.weight_dtype": getattr(args, "weight_dtype", None),
        "server.host": getattr(args, "host", None),
        "server.port": getattr(args, "port", None),
        "server.data_dir": getattr(args, "data_dir", None),
    }
    if args.command == "serve":
        if args.model:
            overrides["default_model"] = args.model
        for key, _ in RESPONSES_FLAGS.values():
            overrides[f"responses.{key}"] = getattr(args, f"responses_{key}")
    return load_config(args.config, overrides=overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from lmspd.cli.progress import pull_progress
    from lmspd.cli.serve import StartupError, check_bind, check_port, run
    from lmspd.models.registry import ModelRegistry
    from lmspd.store.check import check as check_database
    from lmspd.store.url import StoreUrl

    config = _config(args)
    check_bind(config)
    try:
        # First, and read-only: a damaged file or a taken port is refused before any model is fetched.
        store = StoreUrl.parse(config.store.url, config.server.database_path)
        if store.path is not None:
            check_database(store.path)
        else:  # PostgreSQL: reachable, and a schema this lmspd knows (or none yet)
            from lmspd.store.pg import probe

            probe(store)
        check_port(config)
    except LmspdError as exc:
        return _start_failed(StartupError(exc.message))
    with pull_progress() as progress:  # the default model is ready before the first request
        ModelRegistry(config).resolve(config.default_model, progress=progress)
    logging.getLogger("lmspd").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    print(
        f"lmspd starting on http://{config.server.host}:{config.server.port} (database {store})",
        file=sys.stderr,
        flush=True,
    )
    runner: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run
    with contextlib.suppress(ImportError):  # not on Windows
        import uvloop  # about 10% more requests per second, measured with bench/tasks.py

        runner = uvloop.run
    try:
        runner(run(config))
    except StartupError as exc:
        return _start_failed(exc)
    return 0


def _start_failed(exc: LmspdError) -> int:
    """One line, in the server's log format, for systemd's journal (the traceback only with
    --verbose), and exit 1. What started was stopped; should anything still hold the process
    (a thread stuck in a library), it exits anyway: a failed start must never hang."""
    log = logging.getLogger("lmspd.server")
    log.error("cannot start: %s", exc.message)
    log.debug("startup failure", exc_info=exc.__cause__)
    exit_anyway = threading.Timer(EXIT_GRACE_SECS, os._exit, args=(1,))
    exit_anyway.daemon = True
    exit_anyway.start()
    return 1


def cmd_service_print(args: argparse.Namespace) -> int:
    return units.cmd_print(args, _config(args))


def cmd_models_pull(args: argparse.Namespace) -> int:
    from lmspd.cli.progress import pull_progress
    from lmspd.models.registry import ModelRegistry

    config = _config(args)
    name = args.name or config.default_model
    start = time.perf_counter()
    with pull_progress() as progress:
        model = ModelRegistry(config).resolve(name, progress=progress, download=True)
    print(f"{name}: {model.path} ({time.perf_counter() - start:.1f}s)")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from lmspd.models.registry import ModelRegistry

    config = _config(args)
    print(f"cache: {config.model_cache_dir}")
    for info in ModelRegistry(config).list():
        default = " (default)" if info.name == config.default_model else ""
        state = "ready" if info.pulled else "not pulled"
        print(f"{info.name}{default}\t{info.source}\t{state}\t{info.path or ''}\t{info.description}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    from lmspd.cli.progress import pull_progress
    from lmspd.engine import protocol as p
    from lmspd.engine.process import EngineClient
    from lmspd.models.registry import ModelRegistry
    from lmspd.prompting.generation import build_generate
    from lmspd.responses.schema import ResponseRequest

    config = _config(args)
    name = args.model or config.default_model
    registry = ModelRegistry(config)
    with pull_progress() as progress:
        model = registry.resolve(name, progress=progress, download=True)
    messages = [{"role": "user", "content": args.prompt}]
    if args.instructions:
        messages.insert(0, {"role": "system", "content": args.instructions})
    # As a request's: what it names, else the model's defaults (docs/operations.md, "Sampling defaults").
    request = ResponseRequest(input=args.prompt, temperature=args.temperature, top_p=args.top_p)
    sampling = request.sampling(registry.sampling_defaults(name, model))
    cmd = build_generate(
        model, messages, request_id=uuid.uuid4().hex, max_tokens=args.max_output_tokens, sampling=sampling
    )
    engine = EngineClient(config.engine)
    await engine.start()
    try:
        start = time.perf_counter()
        first: float | None = None
        async for event in engine.generate(cmd):
            if isinstance(event, p.Delta):
                first = first or time.perf_counter()
                sys.stdout.write(event.text)
            else:
                sys.stdout.write(event.text + "\n")
                elapsed = time.perf_counter() - (first or start)
                rate = (event.completion_tokens - 1) / elapsed if elapsed > 0 and event.completion_tokens > 1 else 0
                print(
                    f"[{event.reason}: {event.prompt_tokens} prompt + {event.completion_tokens} output tokens, "
                    f"first token {((first or start) - start):.2f}s, {rate:.1f} tok/s]",
                    file=sys.stderr,
                )
            sys.stdout.flush()
    finally:
        await engine.close()
    return 0


def cmd_openapi(args: argparse.Namespace) -> int:
    import msgspec

    from lmspd.api.app import create_app
    from lmspd.api.openapi import document

    print(msgspec.json.format(msgspec.json.encode(document(create_app(Config()).routes)), indent=2).decode())
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from lmspd.cli import doctor

    return doctor.run(_config(args))


def cmd_engine_join(args: argparse.Namespace) -> int:
    from lmspd.engine.group.join import run

    config = _config(args)
    setup_logging(args.log_format, logging.WARNING)
    logging.getLogger("lmspd").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    level = logging.getLogger("lmspd").getEffectiveLevel()
    return run(config.engine, args.rank, level, args.log_format, config.cache_dir)


COMMANDS = {
    ("engine", "join"): cmd_engine_join,
    ("models", "pull"): cmd_models_pull,
    ("models", "list"): cmd_models_list,
    ("generate", None): cmd_generate,
    ("serve", None): cmd_serve,
    ("service", "print"): cmd_service_print,
    ("openapi", None): cmd_openapi,
    ("doctor", None): cmd_doctor,
    **tasks_cli.COMMANDS,
    **models_ctl.COMMANDS,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(getattr(args, "log_format", "text"), logging.DEBUG if args.verbose else logging.WARNING)
    handler = COMMANDS[(args.command, getattr(args, f"{args.command}_command", None))]
    try:
        return handler(args)
    except LmspdError as exc:
        param = f" [{exc.param}]" if exc.param else ""
        print(f"lmspd: error: {exc.code}{param}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lmspd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
