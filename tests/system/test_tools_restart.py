"""Acceptance: ``lmspd serve`` is killed with SIGKILL in the middle of a function call's
arguments, or of a custom tool call's input; after a restart the ``resume`` task finishes the
same call (same ids, same arguments or input) that an uninterrupted run produces, and the
grammar still holds."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from harness.server import Server, read_sse, tiny_server, wait_final
from harness.wait import wait_until
from lmspd.models.registry import ResolvedModel

# Long arguments (28 enum items, ~95 tokens), so the kill lands mid-call with a wide margin.
PARAMS = {
    "type": "object",
    "properties": {"steps": {"type": "array", "items": {"enum": ["north", "south"]}, "minItems": 28, "maxItems": 28}},
    "required": ["steps"],
    "additionalProperties": False,
}
REQUEST = {
    "input": "Plan the route.",
    "tools": [{"type": "function", "name": "route", "parameters": PARAMS}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "temperature": 0,
    "max_output_tokens": 400,
}


@pytest.fixture
def server(tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    with tiny_server(tmp_path, model_cache, tiny_long, engine="max_concurrency = 1\n") as srv:
        yield srv


# A custom tool's input of 40 words (~80 tokens) under a regular expression.
ROUTE = r"(north|south|east|west)( (north|south|east|west)){39}"
WALK = {"type": "custom", "name": "walk", "format": {"type": "grammar", "syntax": "regex", "definition": ROUTE}}
CUSTOM_REQUEST = {**REQUEST, "tools": [WALK]}


def submit(url: str, request: dict[str, Any] = REQUEST) -> str:
    body = {"type": "response", "on_restart": "resume", "input": request}
    r = httpx.post(f"{url}/lmsp/v1/tasks", json=body, timeout=30)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def the_call(task: dict[str, Any], kind: str = "function_call") -> dict[str, Any]:
    (call,) = [item for item in task["response"]["output"] if item["type"] == kind]
    return dict(call)


@pytest.mark.slow
def test_kill_9_mid_arguments_then_resume_gives_the_same_call(server: Server) -> None:
    server.start()
    task_id = submit(server.url)
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(target=read_sse, args=(server.url, task_id, seen), daemon=True)
    reader.start()
    arguments = "response.function_call_arguments.delta"
    wait_until(lambda: sum(e["type"] == arguments for e in list(seen)) >= 8, "the call to get going", interval=0.01)
    server.kill9()
    reader.join(10)
    before = list(seen)
    kinds = [e["type"] for e in before]
    assert "response.function_call_arguments.done" not in kinds  # killed mid-arguments
    added = before[kinds.index("response.output_item.added")]["item"]

    server.start()
    resumed = wait_final(server.url, task_id)
    assert resumed["status"] == "succeeded" and resumed["attempt"] == 1
    events: list[dict[str, Any]] = []
    read_sse(server.url, task_id, events)
    assert events[: len(before)] == before  # nothing a client saw changed
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    call = the_call(resumed)
    assert (call["id"], call["call_id"]) == (added["id"], added["call_id"])
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert streamed == call["arguments"]
    jsonschema.validate(json.loads(call["arguments"]), PARAMS)

    reference = the_call(wait_final(server.url, submit(server.url)))
    assert reference["arguments"] == call["arguments"]  # as an uninterrupted greedy run
    assert server.stop() == 0


@pytest.mark.slow
def test_kill_9_mid_custom_input_then_resume_gives_the_same_call(server: Server) -> None:
    server.start()
    task_id = submit(server.url, CUSTOM_REQUEST)
    seen: list[dict[str, Any]] = []
    reader = threading.Thread(target=read_sse, args=(server.url, task_id, seen), daemon=True)
    reader.start()
    delta = "response.custom_tool_call_input.delta"
    wait_until(lambda: sum(e["type"] == delta for e in list(seen)) >= 8, "the input to get going", interval=0.01)
    server.kill9()
    reader.join(10)
    before = list(seen)
    kinds = [e["type"] for e in before]
    assert "response.custom_tool_call_input.done" not in kinds  # killed mid-input
    added = before[kinds.index("response.output_item.added")]["item"]
    assert added["type"] == "custom_tool_call"

    server.start()
    resumed = wait_final(server.url, task_id)
    assert resumed["status"] == "succeeded" and resumed["attempt"] == 1
    events: list[dict[str, Any]] = []
    read_sse(server.url, task_id, events)
    assert events[: len(before)] == before  # nothing a client saw changed
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    call = the_call(resumed, "custom_tool_call")
    assert (call["id"], call["call_id"], call["status"]) == (added["id"], added["call_id"], "completed")
    assert "".join(e["delta"] for e in events if e["type"] == delta) == call["input"]
    assert re.fullmatch(ROUTE, call["input"])

    reference = the_call(wait_final(server.url, submit(server.url, CUSTOM_REQUEST)), "custom_tool_call")
    assert reference["input"] == call["input"]  # as an uninterrupted greedy run
    assert server.stop() == 0
