"""A task resumed after a kill -9 samples with the model's defaults it was accepted with
(docs/operations.md, "Sampling defaults"), whatever the model's generation_config.json says by
the restart: a greedy task stays greedy, its text that of an uninterrupted run."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.server import read_sse, submit, tiny_server, wait_final
from harness.wait import wait_until
from lmspd.models.registry import ResolvedModel

PROMPT = "Tell me a long story about a dragon."
MAX_TOKENS = 160  # as test_acceptance_restart's: the kill comes with most of them still to go
FINALS = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


def text_of(final: dict[str, Any]) -> str:
    out: str = final["response"]["output"][0]["content"][0]["text"]
    return out


@pytest.mark.slow
def test_a_resumed_task_keeps_the_sampling_defaults_it_was_accepted_with(
    tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel
) -> None:
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny_long.path, tuned)
    settings = tuned / "generation_config.json"
    settings.write_text(json.dumps({"temperature": 0}))
    model = ResolvedModel(name="tiny", path=tuned)
    with tiny_server(tmp_path, model_cache, model, engine="max_concurrency = 1\n") as server:
        server.start()
        body = {
            "type": "response",
            "on_restart": "resume",
            "input": {"input": PROMPT, "max_output_tokens": MAX_TOKENS},  # no temperature: the model's
        }
        r = httpx.post(f"{server.url}/lmsp/v1/tasks", json=body, timeout=30)
        assert r.status_code == 202, r.text
        task_id = r.json()["id"]
        seen: list[dict[str, Any]] = []
        reader = threading.Thread(target=read_sse, args=(server.url, task_id, seen), daemon=True)
        reader.start()
        wait_until(lambda: len(seen) >= 40, "generation to get going (40 events)", interval=0.01)
        server.kill9()
        reader.join(10)
        assert not [e for e in seen if e["type"] in FINALS]  # caught mid-generation
        # By the restart the model samples hot by default: the task must not read that again.
        settings.write_text(json.dumps({"temperature": 2.0}))

        server.start()
        final = wait_final(server.url, task_id)
        assert final["status"] == "succeeded" and final["attempt"] == 1
        assert final["response"]["temperature"] == 0.0
        reference = wait_final(server.url, submit(server.url, "fail", PROMPT, MAX_TOKENS)["id"])  # temperature 0
        assert text_of(final) == text_of(reference)
        assert reference["response"]["usage"]["output_tokens"] == MAX_TOKENS  # the kill left most to generate
        # New requests get the model's defaults as they are now.
        listed = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
        assert listed["tiny"]["sampling_defaults"]["temperature"] == 2.0
        assert server.stop() == 0
