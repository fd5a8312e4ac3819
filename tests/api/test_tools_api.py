"""Function tools and structured output through a real ``lmspd serve`` and the ``openai`` SDK.

The tiny model has random weights: what it says is noise, so every call and JSON
answer below is valid only because decoding is constrained by the request's grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import msgspec
import openai
import pydantic
import pytest

from harness.openresponses import validate, validate_event
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

CITY = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": CITY}
CLOCK: Any = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        # Bounded digits: a float's fraction may run on past any token budget (then the
        # response is incomplete, its JSON cut short), which is not what this test is about.
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2},
    },
    "required": ["answer", "confidence", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tools")
    with tiny_server(tmp, model_cache, tiny_long, engine="max_concurrency = 2\n") as srv:
        srv.start()
        yield srv


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-no-auth", max_retries=0)


def calls_of(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in response["output"] if item["type"] == "function_call"]


def check_call(call: dict[str, Any]) -> None:
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call["status"] == "completed"
    schema = {"get_weather": CITY, "get_time": CLOCK["parameters"]}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), schema)


def test_required_call_then_its_output_closes_the_loop(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tiny",
        input="What is the weather in Paris this week?",
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    body = first.model_dump(mode="json", exclude_unset=True)
    validate("ResponseResource", body)
    assert first.status == "completed"
    (call,) = calls_of(body)
    check_call(call)
    assert body["tools"][0]["name"] == "get_weather" and body["tool_choice"] == "required"
    assert body["parallel_tool_calls"] is False

    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call["call_id"], "output": '{"forecast": "sunny"}'}],
        tools=[WEATHER, CLOCK],
        tool_choice="none",
        max_output_tokens=8,
    )
    validate("ResponseResource", second.model_dump(mode="json", exclude_unset=True))
    assert [item.type for item in second.output] == ["message"]
    assert second.output_text


def test_named_function_streams_its_arguments(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model="tiny",
        input="Forecast for Oslo, please.",
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
    ) as stream:
        events = [event.model_dump(mode="json", exclude_unset=True) for event in stream]
        final = stream.get_final_response()
    for event in events:
        validate_event(event)
    kinds = [e["type"] for e in events]
    added = kinds.index("response.output_item.added")
    assert events[added]["item"]["type"] == "function_call" and events[added]["item"]["arguments"] == ""
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    # How many deltas depends on timing: the server groups what arrives while a commit runs
    # (core/supervisor.py); that the arguments stream piece by piece is tests/unit/test_outputs.py's.
    assert deltas and "".join(deltas) == done["arguments"]
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    (call,) = calls_of(final.model_dump(mode="json", exclude_unset=True))
    assert call["name"] == "get_weather" and call["arguments"] == done["arguments"]
    assert call["id"] == events[added]["item"]["id"] == done["item_id"]
    check_call(call)


def test_json_schema_output_always_validates(client: openai.OpenAI) -> None:
    for prompt in ("Is the sky green?", "Answer in JSON."):
        response = client.responses.create(
            model="tiny",
            input=prompt,
            text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}},
            max_output_tokens=200,
            temperature=0,
        )
        assert response.status == "completed", response.output_text
        body = response.model_dump(mode="json", exclude_unset=True)
        validate("ResponseResource", body)
        assert body["text"]["format"]["type"] == "json_schema" and body["text"]["format"]["name"] == "answer"
        jsonschema.validate(json.loads(response.output_text), ANSWER)


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    score: int = pydantic.Field(ge=0, le=10)


def test_sdk_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model="tiny", input="Is water wet?", text_format=Verdict, max_output_tokens=100)
    assert isinstance(parsed.output_parsed, Verdict)


def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny", input="JSON please", text={"format": {"type": "json_object"}}, max_output_tokens=100
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # a free-form object from random weights may outgrow the budget; it is still one
        assert response.status == "incomplete" and response.output_text.startswith("{")


def test_background_call_is_replayed_after_any_event(server: Server, client: openai.OpenAI) -> None:
    queued = client.responses.create(
        model="tiny",
        input="Time?",
        tools=[WEATHER],
        tool_choice="required",
        background=True,
        max_output_tokens=200,
    )
    url = f"{server.url}/v1/responses/{queued.id}"
    with httpx.stream("GET", url, params={"stream": "true"}, timeout=60) as r:
        events = [msgspec.json.decode(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["type"] == "response.completed"
    for event in events:
        validate_event(event)
    middle = next(e["sequence_number"] for e in events if e["type"] == "response.function_call_arguments.delta")
    with httpx.stream("GET", url, params={"stream": "true", "starting_after": middle}, timeout=60) as r:
        rest = [msgspec.json.decode(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert rest == [e for e in events if e["sequence_number"] > middle]
    check_call(calls_of(client.responses.retrieve(queued.id).model_dump(mode="json", exclude_unset=True))[0])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "if": {}}}}}, "if"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
        ({"tools": [{**WEATHER, "parameters": {"type": "object", "if": {}}}], "tool_choice": "required"}, "if"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
    ],
)
def test_bad_tool_and_format_fields_are_400s_naming_them(server: Server, extra: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", "input": "hi", **extra}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in error["param"], error


def test_reasoning_is_echoed(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny", input="hi", reasoning={"effort": "low", "summary": "auto"}, max_output_tokens=4
    )
    body = response.model_dump(mode="json", exclude_unset=True)
    validate("ResponseResource", body)
    assert body["reasoning"] == {"effort": "low", "summary": "auto"}


def test_chat_completions_tools_and_response_format(client: openai.OpenAI) -> None:
    chat_tool: Any = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    messages: Any = [{"role": "user", "content": "Weather in Lima?"}]
    done = client.chat.completions.create(
        model="tiny", messages=messages, tools=[chat_tool], tool_choice="required", max_tokens=200
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), CITY)

    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[chat_tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        stream=True,
    )
    pieces, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            pieces += [tc.function.arguments or "" for tc in c.delta.tool_calls or [] if tc.function]
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(pieces) > 1
    jsonschema.validate(json.loads("".join(pieces)), CITY)

    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    answer = client.chat.completions.create(model="tiny", messages=messages, response_format=fmt, max_tokens=200)
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), ANSWER)
