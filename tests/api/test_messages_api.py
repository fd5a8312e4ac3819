"""The Anthropic Messages API (docs/messages.md) through the real app and engine: a message and
its stream on the tiny model, tools through the grammar, thinking blocks on the thinker, the
context's limits, pings, errors in Anthropic's envelope, and every bad input a 4xx naming the
field with nothing written.

Every stream is read whole and checked event by event against the order docs/messages.md gives
(:func:`check_stream`); the blocks it builds equal the non-streamed message's shape.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.testclient import TestClient

from harness.engine_host import Host
from harness.families import make_thinker
from harness.sse import named_events
from lmspd.config import Config, EngineConfig, ModelEntry, ResponsesConfig, ServerConfig
from lmspd.models.registry import ResolvedModel

ENGINE = EngineConfig(weight_dtype="quantized")
TOKENS = {"alice": "sk-alice", "bob": "sk-bob"}
HI = "Hi"  # the thinker's prompt: it reasons for two tokens, then answers
WEATHER: dict[str, Any] = {
    "name": "weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
Serve = Callable[..., contextlib.AbstractContextManager[TestClient]]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    return make_thinker(tmp_path_factory.mktemp("messages") / "thinker", smol_dir, HI)


# Many templates (Gemma's, Mistral's, Llama 2's) refuse a conversation that does not alternate
# user / assistant from a user turn, and a system message anywhere but first.
STRICT_TEMPLATE = (
    "{%- set start = 1 if messages[0].role == 'system' else 0 %}"
    "{%- if start %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages[start:] %}"
    "{%- if message.role == 'system' %}{{ raise_exception('System role only first') }}{%- endif %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory, tiny_long: ResolvedModel) -> Path:
    """The tiny model under a template that refuses what many real ones refuse."""
    path = tmp_path_factory.mktemp("strict") / "strict"
    shutil.copytree(tiny_long.path, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": STRICT_TEMPLATE}))
    return path


@pytest.fixture
def serve(
    host: Host, tmp_path: Path, model_cache: Path, thinker: Path, strict: Path, tiny_long: ResolvedModel
) -> Serve:
    """An app on the tiny model (default, 4096 tokens of context) and the thinker, with tokens
    for alice and bob."""

    def make(**changes: Any) -> contextlib.AbstractContextManager[TestClient]:
        server = {"data_dir": str(tmp_path / "data"), "tokens": TOKENS, "keepalive_secs": 0.3}
        server |= changes.pop("server", {})
        config = Config(
            default_model="tiny",
            cache_dir=str(model_cache),
            models={
                "tiny": ModelEntry(path=str(tiny_long.path)),
                "thinker": ModelEntry(path=str(thinker)),
                "strict": ModelEntry(path=str(strict)),
            },
            engine=ENGINE,
            server=msgspec.convert(server, ServerConfig),
            responses=msgspec.convert(changes.pop("responses", {}), ResponsesConfig),
        )
        return host.serve(config)

    return make


@pytest.fixture
def client(serve: Serve) -> Iterator[TestClient]:
    with serve() as c:
        yield c


def key(owner: str = "alice") -> dict[str, str]:
    return {"x-api-key": TOKENS[owner], "anthropic-version": "2023-06-01"}


def body(text: str = "Say something.", **fields: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
    } | fields


def tasks(client: TestClient) -> int:
    db = client.app.state.lmsp.config.server.database_path  # type: ignore[attr-defined]
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM tasks").fetchone()[0])


def create(client: TestClient, payload: dict[str, Any], owner: str = "alice", path: str = "/v1/messages") -> Any:
    r = client.post(path, json=payload, headers=key(owner))
    assert r.status_code == 200, r.text
    return r.json()


def sse(client: TestClient, payload: dict[str, Any], path: str = "/v1/messages") -> list[tuple[str, Any]]:
    """The stream's (event, data) pairs, read to its end."""
    with client.stream("POST", path, json={**payload, "stream": True}, headers=key()) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return named_events(r.iter_lines())


def check_stream(events: list[tuple[str, Any]]) -> dict[str, Any]:
    """Check the order docs/messages.md gives and build the message as a client would: its
    content blocks, stop reason and usage."""
    kinds = [k for k, _ in events if k != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    message = events[0][1]["message"]
    assert message["content"] == [] and message["stop_reason"] is None and message["role"] == "assistant"
    blocks: list[dict[str, Any]] = []
    open_block: int | None = None
    partial: dict[int, str] = {}
    for kind, data in events[1:]:
        if kind == "content_block_start":
            assert open_block is None and data["index"] == len(blocks), data
            open_block = data["index"]
            blocks.append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            assert data["index"] == open_block, data
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                assert block["type"] == "text"
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                assert block["type"] == "tool_use"
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            elif delta["type"] == "thinking_delta":
                assert block["type"] == "thinking" and not block["signature"], "thinking after its signature"
                block["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "signature_delta" and block["type"] == "thinking", delta
                block["signature"] = delta["signature"]
        elif kind == "content_block_stop":
            assert data["index"] == open_block, data
            if data["index"] in partial:
                blocks[data["index"]]["input"] = json.loads(partial[data["index"]])
            open_block = None
        elif kind == "message_delta":
            assert open_block is None
            message.update(data["delta"])
            message["usage"].update(data["usage"])
        else:
            assert kind in ("message_stop", "ping"), kind
    message["content"] = blocks
    return dict(message)


def test_create_answers_a_message(client: TestClient) -> None:
    message = create(client, body())
    assert message["type"] == "message" and message["role"] == "assistant" and message["model"] == "tiny"
    assert message["id"].startswith("msg_")
    assert message["stop_reason"] in ("end_turn", "max_tokens")
    assert [b["type"] for b in message["content"]] in ([], ["text"])
    usage = message["usage"]
    assert usage["output_tokens"] <= 8 and usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    assert usage["cache_creation_input_tokens"] == 0
    assert tasks(client) == 0  # not stored: forgotten once answered


def test_stream_builds_the_same_message(client: TestClient) -> None:
    synced = create(client, body(max_tokens=6))
    streamed = check_stream(sse(client, body(max_tokens=6)))
    assert streamed["content"] == synced["content"]
    assert streamed["stop_reason"] == synced["stop_reason"] == "max_tokens"
    assert streamed["usage"]["output_tokens"] == synced["usage"]["output_tokens"] == 6
    total = streamed["usage"]["input_tokens"] + streamed["usage"]["cache_read_input_tokens"]
    assert total == synced["usage"]["input_tokens"] + synced["usage"]["cache_read_input_tokens"]


def test_count_tokens(client: TestClient) -> None:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}]}
    r = client.post("/v1/messages/count_tokens?beta=true", json=payload, headers=key())
    assert r.status_code == 200, r.text
    counted = r.json()["input_tokens"]
    message = create(client, body(max_tokens=1))
    assert counted == message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"]
    # The template's own default system prompt is replaced by the request's.
    system = "You are a terse assistant. " * 8
    with_system = client.post("/messages/count_tokens", json={**payload, "system": system}, headers=key())
    assert with_system.status_code == 200, with_system.text
    assert with_system.json()["input_tokens"] > counted


def created(client: TestClient) -> float:
    """Tasks ever created by the app (the counter: a refused request creates none, and an
    answered message's task is deleted once answered)."""
    counter = client.app.state.lmsp.core.metrics.tasks_created  # type: ignore[attr-defined]
    totals = [s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total")]
    return float(sum(totals))


def refused(client: TestClient, payload: Any, status: int = 400, path: str = "/v1/messages", **kw: Any) -> str:
    """The refusal's message, checked: Anthropic's envelope, its type for ``status``, no task."""
    before = created(client)
    r = client.post(path, json=payload, headers=kw.pop("headers", key()), **kw)
    assert r.status_code == status, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error", error
    expected = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
    expected |= {413: "request_too_large"}
    assert error["error"]["type"] == expected[status], error
    assert created(client) == before
    return str(error["error"]["message"])


def test_auth_by_api_key_or_bearer(client: TestClient) -> None:
    assert "missing" in refused(client, body(), 401, headers={})
    assert "invalid" in refused(client, body(), 401, headers={"x-api-key": "sk-nobody"})
    r = client.post("/v1/messages", json=body(max_tokens=1), headers={"Authorization": f"Bearer {TOKENS['bob']}"})
    assert r.status_code == 200, r.text
    assert refused(client, body(), 401, path="/messages/count_tokens", headers={})


USE = {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}}
CALLED = {"role": "assistant", "content": [USE]}


def conversation(*messages: Any, **fields: Any) -> dict[str, Any]:
    return body(**fields) | {"messages": list(messages)}


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (body(bogus=1), "bogus"),
        (conversation({"role": "user", "content": "Hi", "name": "x"}), "messages[0].name"),
        (conversation(), "messages"),
        ({k: v for k, v in body().items() if k != "max_tokens"}, "max_tokens"),
        (body(max_tokens=0), "max_tokens"),
        (body(temperature=1.5), "temperature"),
        (
            conversation({"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}),
            "messages[0].content[0].type",
        ),
        (
            conversation({"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}),
            "messages[0].content[0].type",
        ),
        (conversation({"role": "user", "content": [{"type": "video", "url": "x"}]}), "messages[0].content[0].type"),
        (conversation({"role": "user", "content": [USE]}), "messages[0].content[0].type"),
        (
            conversation({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_9"}]}),
            "messages[0].content[0].tool_use_id",
        ),
        (
            conversation(
                {"role": "user", "content": "Hi"},
                CALLED,
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_2", "content": "sunny"}]},
            ),
            "messages[2].content[0].tool_use_id",
        ),
        (
            conversation(
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "call_1"}]},
                {"role": "user", "content": "And?"},
            ),
            "messages[1].content[0].type",
        ),
        (conversation({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}), "messages[1]"),
        (body(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 2000}), "thinking.budget_tokens"),
        (body(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 100}), "thinking.budget_tokens"),
        (body(tools=[{**WEATHER, "input_schema": {"type": "array"}}]), "tools[0].input_schema"),
        (body(tools=[WEATHER, {**WEATHER, "bogus": 1}]), "tools[1].bogus"),
        (body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "tool_choice"),
        (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
        (body(model="nope"), "model"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field_and_writes_nothing(
    client: TestClient, payload: dict[str, Any], field: str
) -> None:
    status = 404 if field == "model" else 400
    message = refused(client, payload, status)
    assert field.removesuffix(".type") in message, message  # a block's type: the block named


def test_a_body_over_the_limit_is_a_413(client: TestClient) -> None:
    huge = body("x" * (10 * 1024 * 1024))
    assert "larger than" in refused(client, huge, 413)


def test_unknown_path_is_not_found_in_anthropic_envelope(client: TestClient) -> None:
    r = client.get("/v1/messages/batches", headers=key())
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text


def test_server_tools_omitted_when_configured(serve: Serve) -> None:
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 1}
    with serve(responses={"hosted_tools": "omit"}) as c:
        r = c.post("/v1/messages", json=body(max_tokens=1, tools=[search, WEATHER]), headers=key())
        assert r.status_code == 200, r.text
        assert r.headers["lmspd-omitted-tools"] == "web_search_20250305"


# --- tools ----------------------------------------------------------------------------------


def without_ids(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Blocks as generated (each call has an id of its own)."""
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def test_tool_choice_any_forces_a_valid_call_and_streams_its_input(client: TestClient) -> None:
    forced = body("Weather?", max_tokens=60, tools=[WEATHER], tool_choice={"type": "any"})
    message = create(client, forced)
    assert message["stop_reason"] == "tool_use", message
    (use,) = [b for b in message["content"] if b["type"] == "tool_use"]
    assert use["name"] == "weather" and use["input"]["city"] in ("Paris", "Oslo") and use["id"]
    streamed = check_stream(sse(client, forced))
    assert without_ids(streamed["content"]) == without_ids(message["content"]) and streamed["stop_reason"] == "tool_use"


def test_a_named_tool_called_once_and_its_result_answered(client: TestClient) -> None:
    other = {**WEATHER, "name": "forecast"}
    choice = {"type": "tool", "name": "forecast", "disable_parallel_tool_use": True}
    first = create(client, body("Weather?", max_tokens=60, tools=[WEATHER, other], tool_choice=choice))
    (use,) = first["content"]
    assert use["type"] == "tool_use" and use["name"] == "forecast", str(first)
    result = {"type": "tool_result", "tool_use_id": use["id"], "content": [{"type": "text", "text": "sunny"}]}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [result]},
    ]
    second = create(client, body(max_tokens=4, tools=[WEATHER, other]) | {"messages": messages})
    assert second["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    # The result is in the prompt: a different one counts differently.
    counted = [
        client.post(
            "/v1/messages/count_tokens",
            json={
                "model": "tiny",
                "tools": [WEATHER, other],
                "messages": [*messages[:2], {"role": "user", "content": [r]}],
            },
            headers=key(),
        ).json()["input_tokens"]
        for r in (result, {**result, "content": "sunny and warm, with a light breeze", "is_error": True})
    ]
    assert counted[0] < counted[1]


def count(client: TestClient, payload: dict[str, Any]) -> int:
    fields = {k: v for k, v in payload.items() if k in ("model", "messages", "system", "tools", "tool_choice")}
    r = client.post(
        "/v1/messages/count_tokens",
        json=fields | {"thinking": payload.get("thinking")} if "thinking" in payload else fields,
        headers=key(),
    )
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


def test_deferred_tools_stay_out_of_the_prompt_until_referenced(client: TestClient) -> None:
    deferred = {**WEATHER, "name": "forecast", "defer_loading": True}
    plain = count(client, body("Weather?"))
    assert count(client, body("Weather?", tools=[deferred])) == plain
    assert count(client, body("Weather?", tools=[WEATHER, deferred])) == count(
        client, body("Weather?", tools=[WEATHER])
    )
    search = {"type": "tool_use", "id": "call_s", "name": "weather", "input": {"city": "Oslo"}}
    reference = {
        "type": "tool_result",
        "tool_use_id": "call_s",
        "content": [{"type": "tool_reference", "tool_name": "forecast"}],
    }
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [search]},
        {"role": "user", "content": [reference]},
    ]
    loaded = count(client, {"model": "tiny", "messages": history, "tools": [WEATHER, deferred]})
    assert loaded > count(client, {"model": "tiny", "messages": history, "tools": [WEATHER]})
    # Not referenced: it cannot be forced either.
    assert "forecast" in refused(
        client, body(tools=[WEATHER, deferred], tool_choice={"type": "tool", "name": "forecast"})
    )
    forced = body(max_tokens=60, tools=[WEATHER, deferred], tool_choice={"type": "tool", "name": "forecast"})
    assert create(client, forced | {"messages": history})["content"][0]["name"] == "forecast"


# --- thinking -------------------------------------------------------------------------------

THINK = {"model": "thinker", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": HI}]}


def thought(client: TestClient, **fields: Any) -> list[dict[str, Any]]:
    """The thinker's answer to "Hi": a thinking block, then text."""
    r = client.post("/v1/messages", json=THINK | fields, headers=key())
    assert r.status_code == 200, r.text
    blocks: list[dict[str, Any]] = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"], blocks
    assert blocks[0]["signature"].startswith("lmspd.r1.")
    return blocks


def test_thinking_blocks_stream_thinking_then_signature(client: TestClient) -> None:
    blocks = thought(client)
    assert blocks[0]["thinking"]
    events = sse(client, THINK)
    streamed = check_stream(events)
    assert without_signatures(streamed["content"]) == without_signatures(blocks)
    assert streamed["content"][0]["signature"].startswith("lmspd.r1.")  # sealed afresh: its own nonce
    deltas = [d["delta"]["type"] for k, d in events if k == "content_block_delta" and d["index"] == 0]
    assert deltas[-1] == "signature_delta" and set(deltas[:-1]) == {"thinking_delta"}, deltas


def without_signatures(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k != "signature"} for b in blocks]


def test_display_omitted_sends_only_the_signature(client: TestClient) -> None:
    omitted = {"thinking": {"type": "adaptive", "display": "omitted"}}
    blocks = thought(client, **omitted)
    assert blocks[0]["thinking"] == ""
    events = sse(client, THINK | omitted)
    deltas = [d["delta"]["type"] for k, d in events if k == "content_block_delta" and d["index"] == 0]
    assert deltas == ["signature_delta"]
    assert check_stream(events)["content"][0]["thinking"] == ""


def replay(blocks: list[dict[str, Any]], then: str = "And?") -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": HI},
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": then},
    ]


def thinker_count(client: TestClient, messages: list[dict[str, Any]], owner: str = "alice", **fields: Any) -> Any:
    """``fields``: other fields of the count request."""
    return client.post(
        "/v1/messages/count_tokens", json={"model": "thinker", "messages": messages} | fields, headers=key(owner)
    )


def test_a_replayed_thinking_block_restores_the_reasoning_exactly(client: TestClient) -> None:
    blocks = thought(client)
    sent = thinker_count(client, replay(blocks)).json()["input_tokens"]
    # The seal is the reasoning: the text beside it, shown or omitted, is not read.
    hidden = [{**blocks[0], "thinking": ""}, blocks[1]]
    assert thinker_count(client, replay(hidden)).json()["input_tokens"] == sent
    redacted = [{"type": "redacted_thinking", "data": blocks[0]["signature"]}, blocks[1]]
    assert thinker_count(client, replay(redacted)).json()["input_tokens"] == sent
    # Without it, the turn is not as generated (for alice, the reasoning echo puts it back:
    # docs/responses.md, "Tools, structured output and reasoning"; bob has none to put back).
    assert thinker_count(client, replay(blocks[1:])).json()["input_tokens"] == sent
    assert thinker_count(client, replay(blocks[1:]), owner="bob").json()["input_tokens"] < sent
    # clear_thinking keeps the last turn's
    keep: dict[str, Any] = {
        "context_management": {
            "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]
        }
    }
    twice = [
        *replay(blocks)[:2],
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": "So?"},
    ]
    all_kept = thinker_count(client, twice).json()["input_tokens"]
    assert thinker_count(client, twice, **keep).json()["input_tokens"] < all_kept
    everything: dict[str, Any] = {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    assert thinker_count(client, twice, **everything).json()["input_tokens"] == all_kept
    # The next turn runs on what was counted.
    message = create(client, THINK | {"messages": replay(blocks), "max_tokens": 1})
    assert message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] == sent


def test_a_forged_or_truncated_signature_is_a_400_naming_the_block(client: TestClient) -> None:
    blocks = thought(client)
    seal = blocks[0]["signature"]
    flipped = seal[:-2] + ("A" if seal[-2] != "A" else "B") + seal[-1]
    for bad in (flipped, seal[:-8], "lmspd.r1.", "EqQBCkgIARABGAIiQL", ""):
        message = refused(client, THINK | {"messages": replay([{**blocks[0], "signature": bad}, blocks[1]])})
        assert message.startswith("messages[1].content[0].signature does not verify"), message
    redacted = [{"type": "redacted_thinking", "data": flipped}, blocks[1]]
    assert "messages[1].content[0].data" in refused(client, THINK | {"messages": replay(redacted)})
    # Sealed for alice: bob cannot pass it off as his.
    r = thinker_count(client, replay(blocks), owner="bob")
    assert r.status_code == 400 and "messages[1].content[0].signature" in r.json()["error"]["message"]


# --- the context, the prompt, stop sequences ------------------------------------------------


def words(n: int) -> str:
    return " ".join(f"w{i % 97}" for i in range(n))


def test_a_prompt_too_long_says_so_as_anthropic_does(client: TestClient) -> None:
    message = refused(client, body(words(5000), max_tokens=32000))
    found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message)
    assert found is not None, message
    assert int(found[1]) > int(found[2]) == 4095  # the tiny model's context leaves one token to answer
    counted = client.post(
        "/v1/messages/count_tokens", json={"model": "tiny", "messages": body(words(5000))["messages"]}, headers=key()
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] == int(found[1])


def test_max_tokens_is_clamped_and_a_full_context_says_so(client: TestClient) -> None:
    """max_tokens past the context is not refused; the answer stops when the context is full."""
    low, high = 1, 4096  # the most words whose prompt leaves a few tokens of the context
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if count(client, body(words(mid))) <= 4090 else (low, mid - 1)
    payload = body(words(low), max_tokens=32000)
    prompt = count(client, payload)
    assert 4080 <= prompt <= 4090
    message = create(client, payload)
    assert message["stop_reason"] == "model_context_window_exceeded", message
    assert message["usage"]["output_tokens"] == 4096 - prompt
    streamed = check_stream(sse(client, payload))
    assert streamed["stop_reason"] == "model_context_window_exceeded"


def test_a_stop_sequence_ends_the_answer_and_is_named(client: TestClient) -> None:
    free = create(client, body(max_tokens=12))["content"][0]["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop.strip(), free
    message = create(client, body(max_tokens=12, stop_sequences=["\x00never", stop]))
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == stop, message
    assert message["content"] == [{"type": "text", "text": free[: free.index(stop)]}] or free.index(stop) == 0
    streamed = check_stream(sse(client, body(max_tokens=12, stop_sequences=[stop])))
    assert streamed["stop_reason"] == "stop_sequence" and streamed["stop_sequence"] == stop


CLAUDE_SYSTEM: list[dict[str, Any]] = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.73b; cc_entrypoint=sdk-cli;"},
    {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral"}},
]


def test_the_billing_header_is_not_rendered(client: TestClient) -> None:
    """Claude Code's first system block changes with its version: left out, the prompt is the
    same whatever the version (the cached prefix holds)."""
    other = [
        {**CLAUDE_SYSTEM[0], "text": "x-anthropic-billing-header: cc_version=9.9.9; cc_entrypoint=cli;"},
        *CLAUDE_SYSTEM[1:],
    ]
    with_header = count(client, body(system=CLAUDE_SYSTEM))
    assert count(client, body(system=other)) == with_header == count(client, body(system=CLAUDE_SYSTEM[1:]))


def test_a_mid_conversation_system_message_renders(client: TestClient) -> None:
    """Claude Code sends its environment as a system message after the user's."""
    env = {"role": "system", "content": "<env>cwd: /work</env>"}
    plain = body(system=CLAUDE_SYSTEM)
    with_env = plain | {"messages": [*plain["messages"], env]}
    assert count(client, with_env) > count(client, plain)
    assert create(client, with_env)["usage"]["output_tokens"] > 0


def test_turn_two_reads_the_prompt_cache(client: TestClient) -> None:
    first = body("Tell me about the sea. " + words(300), max_tokens=4, system=CLAUDE_SYSTEM)
    one = create(client, first)
    again = first | {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": one["content"]},
            {"role": "user", "content": "More."},
        ]
    }
    two = create(client, again)
    assert two["usage"]["cache_read_input_tokens"] >= 300, two["usage"]


def test_a_waiting_stream_pings(client: TestClient) -> None:
    """Nothing to say (a long prefill, a queue; here: the model's slot is held, so the task waits
    for it) is a ping every keep-alive interval; the message follows once it goes on."""
    slots = client.app.state.lmsp.core.supervisor.slots  # type: ignore[attr-defined]
    assert client.portal is not None
    holders = [f"test-{i}" for i in range(slots.limit)]
    for i, holder in enumerate(holders):  # every slot held for other models: tiny cannot load
        client.portal.call(slots.acquire, holder, f"other-{i}")
    events: list[str] = []
    with client.stream("POST", "/v1/messages", json=body(max_tokens=2, stream=True), headers=key()) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            if events[-1:] == ["ping"] and holders:
                for holder in holders:
                    client.portal.call(slots.release, holder)
                holders = []
    assert events[:2] == ["message_start", "ping"] and events[-1] == "message_stop", events


def test_a_template_that_refuses_a_system_turn_gets_it_folded(client: TestClient) -> None:
    env = {"role": "system", "content": "<env>cwd: /work</env>"}
    user = {"role": "user", "content": "Hi"}
    plain = count(client, {"model": "strict", "messages": [user]})
    folded = count(client, {"model": "strict", "messages": [user, env], "system": "Be brief."})
    assert folded > plain
    message = create(client, body(model="strict", max_tokens=2) | {"messages": [user, env]})
    assert message["usage"]["output_tokens"] > 0


def test_first_message_not_user_where_the_template_needs_it(client: TestClient) -> None:
    turns = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi"}]
    message = refused(client, body(model="strict") | {"messages": turns})
    assert message.startswith("messages: ") and "roles must alternate" in message, message
    assert create(client, body(max_tokens=1) | {"messages": turns})["usage"]["output_tokens"] == 1  # ChatML takes it
