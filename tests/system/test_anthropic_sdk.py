"""The official ``anthropic`` SDK against a real ``lmspd serve`` process (docs/messages.md): create,
stream (its accumulator reads every event: ``get_final_message``), a tool round trip, thinking,
``count_tokens``, errors as the SDK's exception classes, and SIGTERM ending an open stream
with an ``error`` event. The tiny model (4096 tokens of context) and the thinker."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from harness.families import make_thinker
from harness.server import Server, tiny_server
from lmspd.models.registry import ResolvedModel

TOKEN = "sk-alice"
WEATHER: Any = {
    "name": "weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> Path:
    return make_thinker(tmp_path_factory.mktemp("sdk-thinker") / "thinker", smol_dir, "Hi")


def start(tmp: Path, model_cache: Path, tiny_long: ResolvedModel, thinker: Path) -> Any:
    return tiny_server(
        tmp,
        model_cache,
        tiny_long,
        server=f'tokens = {{ alice = "{TOKEN}" }}\nkeepalive_secs = 0.5\n',
        models=f'[models.thinker]\npath = "{thinker}"\n',
    )


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, model_cache: Path, tiny_long: ResolvedModel, thinker: Path
) -> Iterator[Server]:
    with start(tmp_path_factory.mktemp("anthropic"), model_cache, tiny_long, thinker) as srv:
        srv.start()
        yield srv


@pytest.fixture
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=TOKEN, max_retries=0)


# This SDK sends no sampling parameters of its own (its create() has none): greedy is asked
# for as a field it does not know, which lmspd takes (docs/messages.md).
GREEDY: Any = {"extra_body": {"temperature": 0}}
HELLO: Any = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}], **GREEDY}


def blocks(message: anthropic.types.Message) -> list[dict[str, Any]]:
    """Content blocks without their ids (each call has its own) and signatures (each seal its own nonce)."""
    return [b.model_dump(exclude={"id", "signature"}, exclude_none=True) for b in message.content]


def test_create_and_stream_give_the_same_message(client: anthropic.Anthropic) -> None:
    created = client.messages.create(**HELLO)
    assert created.type == "message" and created.role == "assistant" and created.stop_reason == "max_tokens"
    assert created.usage.output_tokens == 8 and created.content[0].type == "text"
    with client.messages.stream(**HELLO) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "text" in kinds
    assert blocks(final) == blocks(created) and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8
    inputs = (final.usage.input_tokens or 0) + (final.usage.cache_read_input_tokens or 0)
    assert inputs == created.usage.input_tokens + (created.usage.cache_read_input_tokens or 0)
    counted = client.messages.count_tokens(model="tiny", messages=HELLO["messages"])
    assert counted.input_tokens == inputs


def test_tool_round_trip(client: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Weather in Oslo?"}]
    forced: Any = {
        "model": "tiny",
        "max_tokens": 60,
        "messages": ask,
        "tools": [WEATHER],
        "tool_choice": {"type": "any"},
    }
    first = client.messages.create(**forced, **GREEDY)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "weather" and use.input["city"] in ("Paris", "Oslo")
    with client.messages.stream(**forced, **GREEDY) as stream:
        json_deltas = [e for e in stream if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        streamed = stream.get_final_message()
    assert json_deltas and blocks(streamed) == blocks(first)
    history: Any = [
        *ask,
        {"role": "assistant", "content": first.content},  # sent back as the SDK returned it
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
    ]
    second = client.messages.create(model="tiny", max_tokens=4, messages=history, tools=[WEATHER], **GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert (second.usage.cache_read_input_tokens or 0) > 0  # the first turn's prefix


def test_thinking_streams_and_replays(client: anthropic.Anthropic) -> None:
    think: Any = {
        "model": "thinker",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hi"}],
        **GREEDY,
    }
    with client.messages.stream(**think) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta" and e.index == 0]
        final = stream.get_final_message()
    assert deltas[-1] == "signature_delta" and set(deltas[:-1]) == {"thinking_delta"}
    thinking = final.content[0]
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature.startswith("lmspd.r1.")
    history: Any = [
        *think["messages"],
        {"role": "assistant", "content": final.content},
        {"role": "user", "content": "?"},
    ]
    again = client.messages.create(**(think | {"messages": history}))
    assert again.content
    forged: Any = [
        *history[:1],
        {"role": "assistant", "content": [{**thinking.model_dump(), "signature": "x"}]},
        history[2],
    ]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[0\]\.signature"):
        client.messages.create(**(think | {"messages": forged}))


def test_errors_are_the_sdks_exception_classes(server: Server, client: anthropic.Anthropic) -> None:
    image: Any = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", max_tokens=8, messages=image)
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "messages[0].content[0]" in bad.value.message
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 4095 maximum"):
        too_long: Any = [{"role": "user", "content": "w " * 9000}]
        client.messages.create(model="tiny", max_tokens=32000, messages=too_long, timeout=60)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0).messages.create(**HELLO)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**(HELLO | {"model": "nope"}))
    with pytest.raises(anthropic.RequestTooLargeError):
        client.messages.create(**(HELLO | {"messages": [{"role": "user", "content": "x" * (10 * 1024 * 1024)}]}))
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(**(HELLO | {"max_tokens": 0}))
    # With a Bearer token as Claude Code's ANTHROPIC_AUTH_TOKEN sends it: the same token.
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=TOKEN, max_retries=0)
    assert bearer.messages.create(**(HELLO | {"max_tokens": 1})).usage.output_tokens == 1


def test_sigterm_ends_an_open_stream_with_an_error_event(
    tmp_path: Path, model_cache: Path, tiny_long: ResolvedModel, thinker: Path
) -> None:
    with start(tmp_path, model_cache, tiny_long, thinker) as srv:
        srv.start()
        assert srv.proc is not None
        long = {"model": "tiny", "max_tokens": 3000, "stream": True, "temperature": 0}
        long["messages"] = [{"role": "user", "content": "Tell a story."}]
        events: list[tuple[str, Any]] = []
        kind = ""
        headers = {"x-api-key": TOKEN, "anthropic-version": "2023-06-01"}
        with httpx.stream("POST", f"{srv.url}/v1/messages?beta=true", json=long, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    events.append((kind, json.loads(line[6:])))
                    if kind == "content_block_delta" and srv.proc.poll() is None and len(events) == 3:
                        os.kill(srv.proc.pid, signal.SIGTERM)  # mid-answer
        assert srv.proc.wait(30) == 0
    kinds = [k for k, _ in events]
    assert kinds[0] == "message_start" and "content_block_delta" in kinds and "message_stop" not in kinds, kinds
    last_kind, last = events[-1]
    assert last_kind == "error" and last["error"]["type"] == "overloaded_error", events[-1]
    assert "shutting down" in last["error"]["message"]
