"""The engine dies with its server: after ``kill -9`` of ``lmspd serve`` in the middle of a
long prefill step, its engine process is ended by its lifeline (the kernel's parent-death
signal, or its watch thread), not by reading the pipe's EOF once the step ends.

The real small model with quantized weights prefills at a few tokens per second on a CPU
(and in one step of up to the prefill chunk), so a prompt of some hundred tokens keeps the
engine's main thread in one MLX call for many seconds: the case pipe EOF alone cannot
catch, as the engine reads the pipe only between steps. How soon the engine is gone is a
timing, measured by harness/lifeline.py (against the step it was in), not asserted here."""

from __future__ import annotations

from pathlib import Path

import httpx

from harness.lifeline import PROMPT, alive, engine_of
from harness.server import submit, tiny_server
from harness.wait import wait_until
from lmspd.models.registry import ResolvedModel

# What the engine logs when it reads the pipe's EOF between steps (lmspd.engine.worker): the
# server went away and the engine was left to notice, which the lifeline does not wait for.
EOF_EXIT = "the server went away; engine exiting"


def test_engine_exits_when_the_server_is_killed(tmp_path: Path, model_cache: Path, smol: ResolvedModel) -> None:
    with tiny_server(tmp_path, model_cache, smol) as srv:
        srv.start()
        assert srv.proc is not None
        engine = engine_of(srv.proc.pid)
        task = submit(srv.url, "fail", text=PROMPT, max_tokens=3000)
        url = f"{srv.url}/lmsp/v1/tasks/{task['id']}"
        wait_until(lambda: httpx.get(url, timeout=10).json()["status"] == "running", "the task to start", interval=0.05)
        srv.kill9()
        wait_until(lambda: not alive(engine), "the engine to exit after its server's kill -9", timeout=30)
        assert EOF_EXIT not in srv.log.read_text(), "the engine outlived its server until its step ended"
