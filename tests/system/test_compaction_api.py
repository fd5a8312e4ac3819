"""Acceptance: compaction through a real ``lmspd serve`` (seed "압축"): ``/v1/responses/compact``,
compaction items as input, and ``context_management``. The tiny random-weight models do
the work; one test runs the bundled model."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harness.openresponses import validate, validate_event
from harness.server import Server, tiny_server
from harness.wait import wait_until
from lmspd.models.registry import ResolvedModel

LONG = "The quick brown fox jumps over the lazy dog near the river bank today. " * 12  # ~170 tokens
TOO_LONG = "word " * 300  # more than the 256-token context of the "short" model


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel, tiny: ResolvedModel
) -> Iterator[Server]:
    models = f'[models.smol]\npath = "smollm2-135m-instruct"\n[models.short]\npath = "{tiny.path}"\n'
    # float32: with OpenBLAS the bundled model prefills ~25x faster, and answers as the 4-bit one.
    with tiny_server(
        tmp_path_factory.mktemp("compaction"), model_cache, tiny_long, models=models, dtype="float32"
    ) as srv:
        srv.start()
        yield srv


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-no-auth", max_retries=0)


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def count(server: Server, **body: Any) -> int:
    r = post(server, "/v1/responses/input_tokens", body)
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


def sse(server: Server, method: str, path: str, body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with httpx.stream(method, f"{server.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    for event in events:
        validate_event(event)
    return events


def payload(item: dict[str, Any]) -> dict[str, Any]:
    content = item["encrypted_content"]
    return dict(json.loads(base64.urlsafe_b64decode(content + "=" * (-len(content) % 4))))


def error_of(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return dict(r.json()["error"])


HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": LONG},
    {"role": "assistant", "content": "Noted: a fox, a dog and a river. " * 4},
    {"role": "user", "content": "Which animal jumps?"},
]


def test_compact_then_feed_the_output_back(server: Server, client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.compact(
        model="tiny",
        input=HISTORY,  # type: ignore[arg-type]
        extra_body={"keep_tokens": 16, "max_output_tokens": 8},
    )
    assert raw.parse().output[-1].type == "compaction"  # the SDK reads it
    body = json.loads(raw.text)
    validate("CompactResource", body)
    assert body["object"] == "response.compaction" and body["model"] == "tiny"
    usage = body["usage"]
    assert 0 < usage["output_tokens"] <= 8 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    output = body["output"]
    # Kept system message, the preserved last user message, then exactly one compaction item.
    assert [(i["type"], i.get("role")) for i in output] == [
        ("message", "system"),
        ("message", "user"),
        ("compaction", None),
    ]
    assert output[1]["content"][0]["text"] == "Which animal jumps?"
    item = output[-1]
    assert item["id"].startswith("cmp_")
    decoded = payload(item)
    assert isinstance(decoded["summary"], str)
    assert decoded["items"] == [{"type": "message", "role": "user", "content": "Which animal jumps?"}]

    before = count(server, model="tiny", input=HISTORY)
    after = count(server, model="tiny", input=output)
    assert after < before
    # The compaction item alone stands for the same history (the preserved items are in it).
    assert count(server, model="tiny", input=[output[0], item]) == after
    r = post(server, "/v1/responses", {"model": "tiny", "input": output, "max_output_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == after


def test_compact_refusals(server: Server) -> None:
    # Everything fits keep_tokens: the compacted context could not be shorter.
    err = error_of(post(server, "/v1/responses/compact", {"model": "tiny", "input": "hello"}))
    assert err["code"] == "context_length_exceeded"
    # A history longer than the context window.
    err = error_of(post(server, "/v1/responses/compact", {"model": "short", "input": TOO_LONG}))
    assert err["code"] == "context_length_exceeded" and "context" in err["message"]
    # A malformed compaction item as input.
    bad = [{"role": "user", "content": "hi"}, {"type": "compaction", "encrypted_content": "bm90IGpzb24"}]
    for path in ("/v1/responses", "/v1/responses/input_tokens", "/v1/responses/compact"):
        assert error_of(post(server, path, {"model": "tiny", "input": bad}))["param"] == "input[1].encrypted_content"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"keep_tokens": 0}, "keep_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 16385}, "max_output_tokens"),
        ({"stream": True}, "stream"),
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"conversation": "conv_x"}, "conversation"),
        ({"temperature": 0}, "temperature"),
    ],
)
def test_compact_bad_fields(server: Server, fields: dict[str, Any], param: str) -> None:
    r = post(server, "/v1/responses/compact", {"model": "tiny", "input": "hi", **fields})
    assert error_of(r)["param"] == param
    lmsp = post(server, "/lmsp/v1/responses/compact", {"model": "tiny", "input": "hi", **fields})
    assert lmsp.status_code == 400 and lmsp.json()["param"] == param  # a problem object


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([{"type": "compaction", "compact_threshold": 0}], "context_management[0].compact_threshold"),
        ([{"type": "compaction", "compact_threshold": 100_000_001}], "context_management[0].compact_threshold"),
        ([{"type": "compaction", "compact_threshold": "10"}], "context_management[0].compact_threshold"),
        ([{"type": "compaction"}], "context_management[0].compact_threshold"),
        ([{"type": "truncate", "compact_threshold": 10}], "context_management[0].type"),
        ([{"type": "compaction", "compact_threshold": 10, "x": 1}], "context_management[0].x"),
        ({"type": "compaction"}, "context_management"),
    ],
)
def test_bad_context_management(server: Server, value: Any, param: str) -> None:
    r = post(server, "/v1/responses", {"input": "hi", "context_management": value})
    assert error_of(r)["param"] == param


def test_context_management_compacts_on_the_third_turn(server: Server) -> None:
    def turn(text: str, previous: str | None, threshold: int | None, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"input": text, "max_output_tokens": 16, "temperature": 0, **extra}
        if previous:
            body["previous_response_id"] = previous
        if threshold:
            body["context_management"] = [{"type": "compaction", "compact_threshold": threshold}]
        return body

    first = post(server, "/v1/responses", turn(LONG, None, None)).json()
    second_body = turn("Which animal jumps?", first["id"], None)
    threshold = count(server, **second_body) + 1  # the second turn stays below it, the third crosses it
    second = post(server, "/v1/responses", turn("Which animal jumps?", first["id"], threshold))
    assert second.status_code == 200 and second.json()["output"][0]["type"] == "message"
    second_id = second.json()["id"]
    third_body = turn("And the dog?", second_id, threshold)
    before = count(server, **third_body)
    assert before >= threshold

    events = sse(server, "POST", "/v1/responses", third_body | {"stream": True})
    types = [e["type"] for e in events]
    assert types[:7] == [
        "response.created",
        "response.in_progress",
        "mlx.compaction.started",
        "mlx.compaction.completed",
        "response.output_item.added",
        "response.output_item.done",
        "response.output_item.added",
    ]
    started, completed = events[2], events[3]
    response_id = events[0]["response"]["id"]
    assert started["response_id"] == completed["response_id"] == response_id
    assert started["input_tokens"] == completed["input_tokens_before"] == before
    after = completed["input_tokens_after"]
    assert after < before
    assert events[4]["output_index"] == 0 and events[4]["item"]["type"] == "compaction"
    assert events[6]["output_index"] == 1 and events[6]["item"]["type"] == "message"
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["compaction", "message"]
    assert final["usage"]["input_tokens"] == after
    assert [i["content"] for i in payload(final["output"][0])["items"] if "content" in i][-1] == "And the dog?"

    # The next turn replays the stored summary: below the threshold, nothing is recomputed.
    fourth_body = turn("Thanks.", response_id, threshold)
    assert count(server, **fourth_body) < threshold
    fourth = sse(server, "POST", "/v1/responses", fourth_body | {"stream": True})
    assert not [e for e in fourth if e["type"].startswith("mlx.")]
    assert fourth[-1]["response"]["output"][0]["type"] == "message"

    # The same third turn as an LMSP task: the events are in its durable log, and replayed.
    task = post(server, "/lmsp/v1/tasks", {"type": "response", "input": third_body})
    assert task.status_code == 202, task.text
    task_id, task_response = task.json()["id"], task.json()["response_id"]
    done = ("succeeded", "failed")
    wait_until(lambda: httpx.get(f"{server.url}/lmsp/v1/tasks/{task_id}").json()["status"] in done, "the task to end")
    replay = sse(server, "GET", f"/lmsp/v1/tasks/{task_id}/events")
    assert [e["type"] for e in replay][2:6] == [
        "mlx.compaction.started",
        "mlx.compaction.completed",
        "response.output_item.added",
        "response.output_item.done",
    ]
    assert replay[-1]["type"] == "response.completed" or replay[-1]["type"] == "response.incomplete"
    v1_replay = sse(server, "GET", f"/v1/responses/{task_response}?stream=true")
    assert [e["type"] for e in v1_replay] == [e["type"] for e in replay]


def test_context_management_refusals_and_the_output_cap(server: Server, client: openai.OpenAI) -> None:
    cm = [{"type": "compaction", "compact_threshold": 10}]
    body = {"model": "short", "input": TOO_LONG, "context_management": cm}
    # Sync and streaming: an HTTP 400 before any stream opens.
    assert error_of(post(server, "/v1/responses", body))["code"] == "context_length_exceeded"
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body | {"stream": True}, timeout=60) as r:
        r.read()
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # Background: the job fails (seed: invalid_prompt).
    queued = post(server, "/v1/responses", body | {"background": True})
    assert queued.status_code == 200 and queued.json()["status"] == "queued"

    def ended() -> Any:
        found = client.responses.retrieve(queued.json()["id"])
        return found if found.status not in ("queued", "in_progress") else None

    job = wait_until(ended, "the background job to end")
    assert job.status == "failed" and job.error is not None and job.error.code == "invalid_prompt"

    # Below the threshold, generation stops where the context ends: incomplete, max_output_tokens.
    prompt = "word " * 200
    capped = {"model": "short", "input": prompt, "temperature": 0, "max_output_tokens": 4096}
    capped["context_management"] = [{"type": "compaction", "compact_threshold": 100_000}]
    r = post(server, "/v1/responses", capped)
    assert r.status_code == 200, r.text
    done = r.json()
    if done["status"] == "incomplete":  # random weights: an early EOS would end it completed
        assert done["incomplete_details"] == {"reason": "max_output_tokens"}
        assert done["usage"]["input_tokens"] + done["usage"]["output_tokens"] == 256
    assert done["usage"]["input_tokens"] + done["usage"]["output_tokens"] <= 256


@pytest.mark.real_model
@pytest.mark.slow
def test_compact_on_the_real_model(server: Server, client: openai.OpenAI) -> None:
    history = [
        {"role": "user", "content": "My name is Ann. I live in Oslo."},
        {"role": "assistant", "content": "Nice to meet you, Ann!"},
        {"role": "user", "content": "What is my name?"},
    ]
    raw = client.responses.with_raw_response.compact(
        model="smol",
        input=history,  # type: ignore[arg-type]
        extra_body={"keep_tokens": 8, "max_output_tokens": 12},
    )
    body = json.loads(raw.text)
    validate("CompactResource", body)
    assert [i["type"] for i in body["output"]] == ["message", "compaction"]
    assert payload(body["output"][-1])["summary"]  # greedy: a short English summary
    assert count(server, model="smol", input=body["output"]) < count(server, model="smol", input=history)
