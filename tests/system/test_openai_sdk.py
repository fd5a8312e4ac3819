"""The official ``openai`` SDK against a real ``lmspd serve`` process (tiny model by default)."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pydantic
import pytest

from harness.openresponses import validate, validate_event
from harness.server import Server, tiny_server
from harness.wait import wait_until
from lmspd.engine.prompt_cache import stored_lengths
from lmspd.models.registry import ResolvedModel


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel) -> Iterator[Server]:
    smol = '[models.smol]\npath = "smollm2-135m-instruct"\n'
    # quantized_float32 (auto's choice where lmspd's kernels build): with OpenBLAS the bundled
    # model prefills ~25x faster than on MLX's 4-bit kernel, and answers as the 4-bit one.
    dtype = "quantized_float32"
    with tiny_server(tmp_path_factory.mktemp("sdk"), model_cache, tiny_long, models=smol, dtype=dtype) as srv:
        srv.start()
        yield srv


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-no-auth", max_retries=0)


def raw(server: Server, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, f"{server.url}{path}", timeout=60, **kw)


def wait(client: openai.OpenAI, response_id: str, timeout: float = 60) -> Any:
    def ended() -> Any:
        found = client.responses.retrieve(response_id)
        return found if found.status not in ("queued", "in_progress") else None

    return wait_until(ended, f"{response_id} to end", timeout=timeout, interval=0.05)


@pytest.mark.real_model
@pytest.mark.slow
def test_reply_with_hello_on_the_real_model(client: openai.OpenAI) -> None:
    r = client.responses.create(model="smol", input="Reply with: hello", temperature=0, max_output_tokens=2)
    assert r.output_text.lower().startswith("hello")  # greedy: "Hello! I'm here to help ..."


def test_sync_create_matches_the_schema(server: Server, client: openai.OpenAI) -> None:
    r = client.responses.create(input="Tell me a story.", temperature=0, max_output_tokens=12)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert r.output_text and r.usage.output_tokens == 12  # type: ignore[union-attr]
    body = raw(server, "GET", f"/v1/responses/{r.id}").json()
    validate("ResponseResource", body)
    assert body["background"] is False and body["output"][0]["content"][0]["annotations"] == []


def test_stream_event_order_and_done(server: Server) -> None:
    body = {"input": "Tell me a story.", "temperature": 0, "max_output_tokens": 8, "stream": True}
    events, done = [], False
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        etype = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                etype = line[7:]
            elif line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = msgspec.json.decode(line[6:])
                assert event["type"] == etype
                validate_event(event)
                events.append(event)
    types = [e["type"] for e in events]
    assert done
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_sdk_stream(client: openai.OpenAI) -> None:
    stream = client.responses.create(input="Hi", temperature=0, max_output_tokens=6, stream=True)
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text


def test_background_poll_and_replay(server: Server, client: openai.OpenAI) -> None:
    b = client.responses.create(input="Tell me a story.", background=True, temperature=0, max_output_tokens=10)
    assert b.status == "queued" and b.background is True and b.output == []
    done = wait(client, b.id)
    assert done.status == "incomplete" and done.output_text
    events = []
    with httpx.stream("GET", f"{server.url}/v1/responses/{b.id}?stream=true&starting_after=2", timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(msgspec.json.decode(line[6:]))
    assert events[0]["sequence_number"] == 3 and events[-1]["type"] == "response.incomplete"
    # The same paths work without /v1.
    assert raw(server, "GET", f"/responses/{b.id}").json()["id"] == b.id


def test_cancel_and_delete(client: openai.OpenAI) -> None:
    b = client.responses.create(input="Tell me a story.", background=True, max_output_tokens=3000)
    with pytest.raises(openai.BadRequestError, match="cancel it first"):
        client.responses.delete(b.id)
    cancelled = client.responses.cancel(b.id)
    assert cancelled.status == "cancelled"
    assert client.responses.cancel(b.id).status == "cancelled"  # idempotent
    done = client.responses.create(input="Hi", max_output_tokens=2)
    assert client.responses.cancel(done.id).model_dump() == done.model_dump()  # finished: unchanged
    client.responses.delete(b.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(b.id)


def test_previous_response_chain_renders_the_history(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"temperature": 0, "max_output_tokens": 6}
    r1 = client.responses.create(input="First question.", instructions="Be brief.", **kw)
    r2 = client.responses.create(input="Second question.", previous_response_id=r1.id, **kw)
    r3 = client.responses.create(input="Third question.", previous_response_id=r2.id, **kw)
    assert r3.previous_response_id == r2.id and r3.output_text
    chained = client.responses.input_tokens.count(input="Fourth.", previous_response_id=r3.id).input_tokens
    explicit = client.responses.input_tokens.count(
        input=[
            {"role": "user", "content": "First question."},
            {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "Second question."},
            {"role": "assistant", "content": r2.output_text},
            {"role": "user", "content": "Third question."},
            {"role": "assistant", "content": r3.output_text},
            {"role": "user", "content": "Fourth."},
        ]
    ).input_tokens
    assert chained == explicit  # instructions are not inherited, every turn is there
    alone = client.responses.input_tokens.count(input="Fourth.").input_tokens
    assert chained > alone


def test_output_fed_back_as_input_and_function_items(client: openai.OpenAI) -> None:
    def count(items: list[Any]) -> int:
        return client.responses.input_tokens.count(input=items).input_tokens

    r = client.responses.create(input="Hi", temperature=0, max_output_tokens=4)
    turns: list[Any] = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Again"}]
    items: list[Any] = [turns[0], *[o.model_dump() for o in r.output], turns[1]]
    assert count(items) > count(turns)  # the fed-back output items are in the prompt
    again = client.responses.create(input=items, temperature=0, max_output_tokens=3)
    assert again.status in ("completed", "incomplete") and again.output_text
    question: list[Any] = [{"role": "user", "content": "Weather?"}]
    call: Any = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'}
    result: Any = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    # Each function item is rendered into the prompt.
    assert count(question) < count([*question, call]) < count([*question, call, result])
    answer = client.responses.create(input=[*question, call, result], temperature=0, max_output_tokens=3)
    assert answer.status in ("completed", "incomplete") and answer.output_text


def test_store_false(client: openai.OpenAI) -> None:
    r = client.responses.create(input="Hi", max_output_tokens=2, store=False)
    assert r.model_dump()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    b = client.responses.create(input="Hi", max_output_tokens=2, store=False, background=True)
    assert wait(client, b.id).status in ("completed", "incomplete")  # readable for the ephemeral TTL
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(input="Next", previous_response_id=b.id)


def test_unfinished_previous_response(client: openai.OpenAI) -> None:
    b = client.responses.create(input="Tell me a story.", background=True, max_output_tokens=3000)
    with pytest.raises(openai.BadRequestError, match=f"previous response '{b.id}' has not finished"):
        client.responses.create(input="Next", previous_response_id=b.id)
    client.responses.cancel(b.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(input="Next", previous_response_id="resp_unknown")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
        ({"background": True, "stream": True}, "stream"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"conversation": "conv_1", "previous_response_id": "resp_x"}, "conversation"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"model": "ghost"}, "model"),
    ],
)
def test_bad_requests_use_the_openai_envelope(server: Server, extra: dict[str, Any], param: str) -> None:
    r = raw(server, "POST", "/v1/responses", json={"input": "Hi", **extra})
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    # The LMSP path answers the same request with a problem object.
    p = raw(server, "POST", "/lmsp/v1/responses", json={"input": "Hi", **extra})
    assert p.headers["content-type"] == "application/problem+json" and p.json()["param"] == param


def test_models(client: openai.OpenAI) -> None:
    assert {"tiny", "smol", "smollm2-135m-instruct"} <= {m.id for m in client.models.list()}


@pytest.mark.slow  # kills the module's server and starts it again
def test_stored_responses_survive_kill_and_restart(server: Server, client: openai.OpenAI) -> None:
    stored = client.responses.create(input="Remember me.", temperature=0, max_output_tokens=5)
    running = client.responses.create(input="Tell me a story.", background=True, max_output_tokens=3000)
    wait_until(lambda: client.responses.retrieve(running.id).status != "queued", "the background response to start")
    server.kill9()
    server.start()
    again = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    assert again.responses.retrieve(stored.id).model_dump() == stored.model_dump()
    interrupted = again.responses.retrieve(running.id)
    assert interrupted.status == "failed" and interrupted.error.code == "server_restarted"  # type: ignore[union-attr]


def test_the_next_turn_reuses_the_prompt_cache_even_after_kill_9(server: Server, client: openai.OpenAI) -> None:
    # A key of its own; the client's entries under other keys may still lend turn 1 the prefix
    # every prompt starts with (the template's opening), never the question.
    kw: dict[str, Any] = {"temperature": 0, "max_output_tokens": 8, "prompt_cache_key": uuid.uuid4().hex}
    first = client.responses.create(input=f"Tell me about rivers, {uuid.uuid4().hex}.", **kw)
    assert first.usage is not None
    assert first.usage.input_tokens_details.cached_tokens < first.usage.input_tokens - 8
    folder = server.config.parent / "data" / "prompt-cache"
    # Files other tests of the module left (other keys, maybe longer): not turn 2's.
    earlier = frozenset(folder.rglob("*.safetensors"))
    second = client.responses.create(input="And lakes?", previous_response_id=first.id, **kw)
    assert second.usage is not None
    # At least turn 1's prompt comes from the cache (its answer too, where it re-tokenizes the same).
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # Turn 2's cache is written to disk once the engine is idle (turn 1's may land later than
    # turn 1's answer, so wait for a new file as long as turn 2's input, not just a new file).
    turn_2 = second.usage.input_tokens
    wait_until(lambda: max(stored_lengths(folder, skip=earlier), default=0) >= turn_2, "turn 2's prompt cache file")
    server.kill9()
    server.start()
    again = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    third = again.responses.create(input="And seas?", previous_response_id=second.id, **kw)
    assert third.usage is not None
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens


def test_many_requests_at_once_all_succeed(client: openai.OpenAI) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> str:
        r = client.responses.create(input=f"Question {i}", temperature=0, max_output_tokens=4)
        assert r.status is not None
        return r.status

    with ThreadPoolExecutor(16) as pool:  # 4x the engine's slots: the rest wait in the queue
        statuses = list(pool.map(one, range(16)))
    assert set(statuses) <= {"completed", "incomplete"} and len(statuses) == 16


def test_conversation_through_the_sdk(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"temperature": 0, "max_output_tokens": 5, "conversation": "conv_sdk"}
    first = client.responses.create(input="Turn one.", **kw)
    second = client.responses.create(input="Turn two.", **kw)
    assert first.output_text and second.output_text
    with_history = client.responses.input_tokens.count(input="Three.", conversation="conv_sdk").input_tokens
    assert with_history > client.responses.input_tokens.count(input="Three.").input_tokens


def test_every_kind_of_response_object_matches_the_schema(server: Server, client: openai.OpenAI) -> None:
    queued = raw(server, "POST", "/v1/responses", json={"input": "Hi", "background": True, "max_output_tokens": 3000})
    validate("ResponseResource", queued.json())
    rid = queued.json()["id"]
    cancelled = raw(server, "POST", f"/v1/responses/{rid}/cancel")
    validate("ResponseResource", cancelled.json())
    assert cancelled.json()["status"] == "cancelled"
    done = client.responses.create(input="Hi", max_output_tokens=3, background=True)
    finished = wait(client, done.id)
    validate("ResponseResource", raw(server, "GET", f"/v1/responses/{finished.id}").json())
    stored = raw(server, "POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 3}).json()
    validate("ResponseResource", stored)


# --- tools and structured output on the bundled model (real weights) ------------------------

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population: int = pydantic.Field(ge=0, le=10**9)


# The bundled model prefills ~6 tokens/s on this CPU, and a tool block is a few hundred tokens:
# these run in the full real-model pass (LMSPD_SCHEMA_MATRIX=full, as the 60-schema matrix),
# not in the suite's five minutes. The suite keeps the SDK's parse on real weights.
FULL = os.environ.get("LMSPD_SCHEMA_MATRIX") == "full"
full_only = pytest.mark.skipif(not FULL, reason="full real-model pass only (LMSPD_SCHEMA_MATRIX=full)")


@pytest.mark.real_model
def test_sdk_parse_on_the_real_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model="smol", input="Paris as JSON.", text_format=City, temperature=0, max_output_tokens=80
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)


@full_only
@pytest.mark.real_model
def test_function_call_loop_on_the_real_model(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "smol", "tools": [WEATHER], "temperature": 0}
    first = client.responses.create(
        input="What's the weather in Paris?", tool_choice="required", max_output_tokens=60, **kw
    )
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    answer = client.responses.create(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}],
        max_output_tokens=16,
        **kw,
    )
    assert answer.output_text and answer.output[-1].type == "message"


@full_only
@pytest.mark.real_model
def test_streamed_arguments_on_the_real_model(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model="smol",
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    call = next(item for item in final.output if item.type == "function_call")
    assert len(deltas) > 1 and "".join(deltas) == call.arguments


@full_only
@pytest.mark.real_model
@pytest.mark.slow  # kills the module's server and starts it again
def test_background_structured_output_survives_kill_9(server: Server, client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "city", "schema": City.model_json_schema(), "strict": True}
    queued = client.responses.create(
        model="smol", input="Oslo as JSON.", text={"format": fmt}, background=True, max_output_tokens=120
    )
    done = wait(client, queued.id, timeout=300)
    assert done.status == "completed"
    server.kill9()
    server.start()
    again = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    read_back = again.responses.retrieve(queued.id)
    assert read_back.model_dump() == done.model_dump()
    City.model_validate_json(read_back.output_text)
