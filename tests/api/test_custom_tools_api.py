"""Custom (freeform) tools through a real ``lmspd serve`` on the tiny random model and the
``openai`` SDK: a forced custom call streams its raw input (every event validated), its output
item closes the loop, its events replay from the log, and a bad grammar is a 400 that stores
nothing. Random weights: the input is valid only because the grammar holds it."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from llguidance import LLMatcher, LLTokenizer

from harness.openresponses import validate, validate_event
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

SETTINGS = r"""start: entry ("\n" entry){0,2} "\n"
entry: KEY "=" VALUE
KEY: /[a-z]{1,6}/
VALUE: /[0-9]{1,3}/ | "yes" | "no"
"""
CONFIGURE: Any = {
    "type": "custom",
    "name": "configure",
    "description": "Set options, one key=value a line",
    "format": {"type": "grammar", "syntax": "lark", "definition": SETTINGS},
}
STAMP: Any = {
    "type": "custom",
    "name": "stamp",
    "format": {"type": "grammar", "syntax": "regex", "definition": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("custom")
    with tiny_server(tmp, model_cache, tiny_long, engine="max_concurrency = 2\n") as srv:
        srv.start()
        yield srv


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-no-auth", max_retries=0)


def in_grammar(tiny_long: ResolvedModel, definition: str, text: str) -> bool:
    tok = LLTokenizer((Path(tiny_long.path) / "tokenizer.json").read_text())
    matcher = LLMatcher(tok, LLMatcher.grammar_from_lark(definition), log_level=0)
    return bool(matcher.consume_tokens(tok.tokenize_str(text)) and matcher.is_accepting())


@pytest.mark.parametrize("choice", ["required", {"type": "custom", "name": "configure"}], ids=["required", "named"])
def test_forced_custom_call_streams_its_raw_input(client: openai.OpenAI, tiny_long: ResolvedModel, choice: Any) -> None:
    with client.responses.stream(
        model="tiny",
        input="Turn on dark mode.",
        tools=[CONFIGURE, STAMP],
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=200,
    ) as stream:
        events = [event.model_dump(mode="json", exclude_unset=True) for event in stream]
        final = stream.get_final_response().model_dump(mode="json", exclude_unset=True)
    for event in events:
        validate_event(event)
    validate("ResponseResource", final)
    assert final["status"] == "completed" and final["tools"][0]["type"] == "custom"
    (call,) = final["output"]
    assert call["type"] == "custom_tool_call" and call["status"] == "completed"
    kinds = [e["type"] for e in events]
    added = events[kinds.index("response.output_item.added")]["item"]
    assert (added["id"], added["call_id"], added["input"]) == (call["id"], call["call_id"], "")
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    done = events[kinds.index("response.custom_tool_call_input.done")]
    assert "".join(deltas) == done["input"] == call["input"]
    assert kinds.index("response.custom_tool_call_input.done") < kinds.index("response.output_item.done")
    if call["name"] == "configure":
        assert in_grammar(tiny_long, SETTINGS, call["input"]), call["input"]
    else:
        assert choice == "required" and call["name"] == "stamp"


def test_the_call_and_its_output_close_the_loop(server: Server, client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tiny",
        input="Turn on dark mode.",
        tools=[CONFIGURE],
        tool_choice="required",
        temperature=0,
        max_output_tokens=200,
    )
    (call,) = first.output
    assert call.type == "custom_tool_call"
    result: Any = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "dark=yes: done"}
    chained = client.responses.create(
        model="tiny", previous_response_id=first.id, input=[result], tools=[CONFIGURE], max_output_tokens=8
    )
    validate("ResponseResource", chained.model_dump(mode="json", exclude_unset=True))
    assert chained.status in ("completed", "incomplete")
    # The same turn sent back by hand, the SDK's own item and text parts as the output.
    history: Any = [
        {"role": "user", "content": "Turn on dark mode."},
        call.model_dump(mode="json", exclude_none=True),
        {**result, "output": [{"type": "input_text", "text": "dark=yes: done"}]},
    ]
    replayed = client.responses.create(model="tiny", input=history, tools=[CONFIGURE], max_output_tokens=8)
    assert replayed.usage is not None and chained.usage is not None
    listed = httpx.get(f"{server.url}/v1/responses/{replayed.id}/input_items?order=asc", timeout=10).json()["data"]
    assert [i["type"] for i in listed] == ["message", "custom_tool_call", "custom_tool_call_output"]
    assert listed[1]["input"] == call.input and listed[1]["call_id"] == call.call_id


def test_a_background_custom_call_replays_from_any_event(server: Server, client: openai.OpenAI) -> None:
    started = client.responses.create(
        model="tiny",
        input="Stamp it.",
        tools=[STAMP],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
        background=True,
    )
    with httpx.stream("GET", f"{server.url}/v1/responses/{started.id}?stream=true", timeout=60) as r:
        whole = [msgspec.json.decode(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for event in whole:
        validate_event(event)
    assert whole[-1]["type"] == "response.completed"
    (call,) = whole[-1]["response"]["output"]
    assert call["type"] == "custom_tool_call"
    for after in range(-1, len(whole) - 1, 3):
        url = f"{server.url}/v1/responses/{started.id}?stream=true&starting_after={after}"
        with httpx.stream("GET", url, timeout=60) as r:
            tail = [msgspec.json.decode(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert tail == whole[after + 1 :]


def tasks_count(server: Server) -> int:
    with sqlite3.connect(server.config.parent / "data" / "lmspd.db") as db:
        return int(db.execute("SELECT count(*) FROM tasks").fetchone()[0])


def with_definition(tool: dict[str, Any], definition: str) -> dict[str, Any]:
    return {**tool, "format": {**tool["format"], "definition": definition}}


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "function", "name": "f"}, with_definition(CONFIGURE, "start: x")], "tools[1].format.definition"),
        ([with_definition(STAMP, "20([")], "tools[0].format.definition"),
        (
            [{"type": "namespace", "name": "ns", "tools": [with_definition(STAMP, "(")]}],
            "tools[0].tools[0].format.definition",
        ),
    ],
    ids=["lark", "regex", "namespaced"],
)
def test_a_bad_grammar_is_a_400_naming_it_and_stores_nothing(
    server: Server, tools: list[dict[str, Any]], param: str
) -> None:
    before = tasks_count(server)
    body = {"model": "tiny", "input": "x", "tools": tools, "stream": True}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "grammar does not compile" in error["message"]
    assert tasks_count(server) == before
