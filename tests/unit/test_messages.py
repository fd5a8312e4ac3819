"""The Messages view (docs/messages.md): request decoding and translation, the names of refused
fields, messages and their stream events.

Pure translation (no HTTP, no DB). Produced objects and events are also validated against the
``anthropic`` SDK's own pydantic models, extra keys included, so the official client parses them.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pydantic
import pytest
from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent

from harness.openresponses import assert_no_extras
from lmspd.api.wire import decode
from lmspd.errors import ContextLengthExceededError, InvalidRequestError, QueueFullError, UnauthorizedError
from lmspd.messages.params import name_messages_fields, translate
from lmspd.messages.schema import CountTokensRequest, MessagesRequest, Translation
from lmspd.messages.view import MessageStream, Shape, error_body, message, stop_reason
from lmspd.responses import schema as s
from lmspd.responses.inputs import parse_items
from lmspd.store.task_store import Event

TOOL = {"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
USE = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}


def request(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode(json.dumps(body).encode(), MessagesRequest)


def translated(**fields: Any) -> Translation:
    return translate(request(**fields))[0]


def refused(**fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        translated(**fields)
    return info.value


# --- requests -------------------------------------------------------------------------------


def test_claude_codes_request_decodes_and_translates() -> None:
    """The shape Claude Code 2.1.332 sends (docs/messages.md, "Claude Code")."""
    t = translated(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.73b; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "<reminder/>"}, {"type": "text", "text": "hello"}]},
            {"role": "system", "content": "<env>cwd</env>"},
        ],
        tools=[TOOL, {**TOOL, "name": "Placeholder", "defer_loading": True}],
        metadata={"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        max_tokens=32000,
        thinking={"type": "adaptive", "display": "omitted"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        stream=True,
    )
    r = t.request
    assert r.instructions == "You are Claude Code.\n\nBe terse."  # no billing header
    assert r.input == [
        {"role": "user", "content": "<reminder/>\n\nhello"},
        {"role": "system", "content": "<env>cwd</env>"},
    ]
    assert [tool["name"] for tool in r.tools or []] == ["weather"]  # the deferred one is left out
    assert r.tools and r.tools[0]["parameters"] == TOOL["input_schema"] and r.tools[0]["strict"] is False
    assert r.max_output_tokens == 32000 and r.store is False and r.stream is True
    assert r.sealed_reasoning and t.display_omitted and t.max_tokens == 32000
    assert r.metadata is None  # the user id is never rendered nor stored as metadata


def test_what_claude_code_sends_for_other_models_and_outputs_is_accepted() -> None:
    """Claude Code 2.1.332 puts ``output_config: {"effort": …}`` on its environment's system
    message for some models (its default, ``claude-opus-5-5``), and asks for ``thinking.display:
    "updates"`` when it prints a stream (``--output-format stream-json``): both accepted, the
    first changing nothing, the second showing the thinking as "summarized" does."""
    env = {"role": "system", "content": "<env/>", "output_config": {"effort": "medium"}}
    t = translated(
        messages=[{"role": "user", "content": "hi"}, env], thinking={"type": "adaptive", "display": "updates"}
    )
    assert t.request.input == [{"role": "user", "content": "hi"}, {"role": "system", "content": "<env/>"}]
    assert not t.display_omitted
    enabled = translated(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024, "display": "updates"})
    assert not enabled.display_omitted
    err = refused(messages=[{"role": "user", "content": "hi", "output_config": {"effort": "low"}}])
    assert err.param == "messages[0].output_config" and "only a system message" in str(err)


def test_choices_parallel_sampling_and_stops() -> None:
    def choice(tc: dict[str, Any]) -> tuple[Any, Any]:
        r = translated(tools=[TOOL], tool_choice=tc).request
        return r.tool_choice, r.parallel_tool_calls

    assert choice({"type": "auto"}) == ("auto", None)
    assert choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    assert choice({"type": "tool", "name": "weather"}) == ({"type": "function", "name": "weather"}, None)
    assert choice({"type": "none"}) == ("none", None)
    r = translated(temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["END"]).request
    assert (r.temperature, r.top_p, r.top_k, r.stop) == (0.5, 0.9, 40, ["END"])
    assert r.sampling().top_k == 40
    fmt = translated(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}}).request.text
    assert fmt == {"format": {"type": "json_schema", "name": "output", "schema": {"type": "object"}, "strict": True}}
    off = translated(thinking={"type": "disabled"}).request
    assert off.chat_template_kwargs == {"enable_thinking": False}


def test_a_conversation_becomes_items_with_their_origins() -> None:
    t = translated(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "lmspd.r1.x"},
                    {"type": "text", "text": "Let me look."},
                    USE,
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny", "is_error": True},
                    {"type": "text", "text": "thanks"},
                ],
            },
        ]
    )
    kinds = [item.get("type", "message") for item in t.request.input]  # type: ignore[union-attr]
    assert kinds == ["message", "reasoning", "message", "function_call", "function_call_output", "message"]
    assert t.request.input[1] == {"type": "reasoning", "summary": [], "encrypted_content": "lmspd.r1.x"}
    assert t.request.input[3]["arguments"] == '{"city": "Oslo"}'  # type: ignore[index]
    assert t.request.input[4]["output"] == "Error: sunny"  # type: ignore[index]
    assert [o.path for o in t.items] == [
        "messages[0]",
        "messages[1].content[0]",
        "messages[1]",
        "messages[1].content[2]",
        "messages[2].content[0]",
        "messages[2]",
    ]
    parse_items(list(t.request.input))  # what the core reads


def test_clear_thinking_keeps_the_last_turns_reasoning() -> None:
    thinking = {"type": "thinking", "thinking": "t", "signature": "sig"}
    turn = [
        {"role": "assistant", "content": [thinking, {"type": "text", "text": "a"}]},
        {"role": "user", "content": "b"},
    ]
    keep = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}
    t = translated(messages=[{"role": "user", "content": "q"}, *turn, *turn], context_management=keep)
    reasoning = [i for i in t.request.input if i.get("type") == "reasoning"]  # type: ignore[union-attr]
    assert reasoning == [
        {"type": "reasoning", "summary": []},
        {"type": "reasoning", "summary": [], "encrypted_content": "sig"},
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 2}, "temperature"),
        ({"stop_sequences": [""]}, "stop_sequences[0]"),
        ({"messages": [{"role": "user", "content": [USE]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": [USE]},
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "toolu_1",
                                "content": [{"type": "document", "source": {}}],
                            }
                        ],
                    },
                ]
            },
            "messages[2].content[0].content[0].type",
        ),
        ({"messages": [{"role": "system", "content": [USE]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "messages[1].role"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tools": [{**TOOL, "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
        ({"tools": [TOOL, {**TOOL, "name": "bad name"}]}, "tools[1].name"),
        ({"tools": [TOOL, TOOL]}, "tools[1].name"),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        (
            {
                "context_management": {
                    "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]
                }
            },
            "context_management.edits[0].keep.value",
        ),
    ],
)
def test_refusals_name_the_messages_field(fields: dict[str, Any], param: str) -> None:
    exc = refused(**fields)
    assert exc.param == param, (exc.param, exc.message)
    assert param in exc.message or exc.message.startswith(param.rpartition(".")[0] + ":"), exc.message


def test_unknown_fields_and_blocks_name_themselves() -> None:
    for body, param in (
        ({"bogus": 1}, "bogus"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}]},
            "messages[0].content[0].extra",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2000, "x": 1}}, "thinking.x"),
        ({"context_management": {"edits": [{"type": "compact_20990101"}]}}, "context_management.edits[0].type"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            request(**body)
        assert info.value.param == param, info.value.message
    with pytest.raises(InvalidRequestError) as info:
        decode(b'{"model": "m", "messages": [], "max_tokens": 3}', CountTokensRequest)
    assert info.value.param == "max_tokens"  # count_tokens takes no max_tokens


def test_core_refusals_are_renamed_to_the_messages_fields() -> None:
    t = translated(
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "bad"}, USE]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
        ],
        tools=[{**TOOL, "defer_loading": True, "name": "later"}, TOOL],
    )
    seal = InvalidRequestError("input[1].encrypted_content does not verify", param="input[1].encrypted_content")
    name_messages_fields(seal, t)
    assert (seal.param, seal.message) == (
        "messages[1].content[0].signature",
        "messages[1].content[0].signature does not verify",
    )
    schema = InvalidRequestError("unsupported keyword", param="tools[0].parameters.properties.city")
    name_messages_fields(schema, t)
    assert schema.param == "tools[1].input_schema.properties.city"  # the deferred tools[0] is not offered
    assert schema.message.startswith("tools[1].input_schema.properties.city: ")
    long = ContextLengthExceededError("the input is 9000 tokens", param="input", tokens=9000, maximum=8191)
    name_messages_fields(long, t)
    assert (long.message, long.param) == ("prompt is too long: 9000 tokens > 8191 maximum", "messages")


def test_error_bodies_take_anthropics_types_and_statuses() -> None:
    for exc, status, kind in (
        (InvalidRequestError("x"), 400, "invalid_request_error"),
        (UnauthorizedError("x"), 401, "authentication_error"),
        (QueueFullError("x"), 529, "overloaded_error"),
        (ContextLengthExceededError("x"), 400, "invalid_request_error"),
    ):
        assert exc.anthropic_http_status == status
        assert msgspec.to_builtins(error_body(exc)) == {"type": "error", "error": {"type": kind, "message": "x"}}


# --- messages and streams -------------------------------------------------------------------

SHAPE = Shape(message_id="msg_1", model="m", max_tokens=50)
USAGE = s.Usage(
    input_tokens=30, output_tokens=12, total_tokens=42, input_tokens_details=s.InputTokensDetails(cached_tokens=20)
)
REASONING = s.Reasoning(
    id="rs_1", content=[s.ReasoningText("think")], status="completed", encrypted_content="lmspd.r1.seal"
)
TEXT = s.OutputMessage(id="msg_x", status="completed", content=[s.OutputText("Hello")])
CALL = s.FunctionCall(id="fc_1", call_id="call_1", name="weather", arguments='{"city": "Oslo"}', status="completed")


def response(*output: s.OutputItem, **changes: Any) -> s.Response:
    fields: dict[str, Any] = {
        "id": "resp_1",
        "created_at": 0,
        "status": "completed",
        "model": "m",
        "output": list(output),
        "usage": USAGE,
    }
    return s.Response(**(fields | changes))


def sdk_message(obj: msgspec.Struct) -> SdkMessage:
    parsed = SdkMessage.model_validate(msgspec.to_builtins(obj))
    assert_no_extras(parsed)
    return parsed


def test_a_message_has_blocks_usage_and_stop_reason() -> None:
    m = sdk_message(message(response(REASONING, TEXT, CALL), SHAPE))
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "think" and m.content[0].signature == "lmspd.r1.seal"  # type: ignore[union-attr]
    assert m.content[2].input == {"city": "Oslo"} and m.content[2].id == "call_1"  # type: ignore[union-attr]
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (10, 20, 12)
    omitted = message(response(REASONING, TEXT), Shape(message_id="msg_1", model="m", display_omitted=True))
    assert omitted.content[0] == msgspec.convert(
        {"type": "thinking", "thinking": "", "signature": "lmspd.r1.seal"}, type(omitted.content[0])
    )
    empty = message(response(s.OutputMessage(id="msg_x", status="completed")), SHAPE)
    assert empty.content == [] and empty.stop_reason == "end_turn"


def test_stop_reasons() -> None:
    cut = {"status": "incomplete", "incomplete_details": s.IncompleteDetails("max_output_tokens")}
    full = s.Usage(input_tokens=30, output_tokens=50, total_tokens=80)
    assert stop_reason(response(TEXT, **cut, usage=full), 50) == "max_tokens"
    assert stop_reason(response(TEXT, **cut), 50) == "model_context_window_exceeded"  # 12 of 50: the context filled
    assert stop_reason(response(TEXT, stop_sequence="END"), 50) == "stop_sequence"
    assert stop_reason(response(TEXT), 50) == "end_turn"
    assert stop_reason(response(TEXT, status="cancelled"), 50) == "end_turn"


def event_log(*output: s.OutputItem, final: s.Response | None = None) -> list[Event]:
    """The log a generation writes for ``output`` (item by item, the text and arguments in pieces)."""
    events: list[Any] = [s.ResponseCreated(sequence_number=0, response=response(status="in_progress", usage=None))]

    def add(event: Any) -> None:
        events.append(event)

    for index, item in enumerate(output):
        n = len(events)
        if isinstance(item, s.Reasoning):
            add(s.OutputItemAdded(sequence_number=n, output_index=index, item=s.Reasoning(id=item.id)))
            for piece in ("thi", "nk"):
                add(
                    s.ReasoningTextDelta(
                        sequence_number=0, item_id=item.id, output_index=index, content_index=0, delta=piece
                    )
                )
            add(
                s.ReasoningTextDone(
                    sequence_number=0, item_id=item.id, output_index=index, content_index=0, text="think"
                )
            )
        elif isinstance(item, s.OutputMessage):
            add(
                s.OutputItemAdded(
                    sequence_number=0, output_index=index, item=s.OutputMessage(id=item.id, status="in_progress")
                )
            )
            add(
                s.ContentPartAdded(
                    sequence_number=0, item_id=item.id, output_index=index, content_index=0, part=s.OutputText("")
                )
            )
            for piece in ("", "Hel", "lo"):
                add(
                    s.OutputTextDelta(
                        sequence_number=0, item_id=item.id, output_index=index, content_index=0, delta=piece
                    )
                )
            add(s.OutputTextDone(sequence_number=0, item_id=item.id, output_index=index, content_index=0, text="Hello"))
            add(
                s.ContentPartDone(
                    sequence_number=0, item_id=item.id, output_index=index, content_index=0, part=s.OutputText("Hello")
                )
            )
        elif isinstance(item, s.FunctionCall):
            add(
                s.OutputItemAdded(
                    sequence_number=0,
                    output_index=index,
                    item=msgspec.structs.replace(item, arguments="", status="in_progress"),
                )
            )
            for piece in ('{"city"', ': "Oslo"}'):
                add(s.FunctionCallArgumentsDelta(sequence_number=0, item_id=item.id, output_index=index, delta=piece))
            add(
                s.FunctionCallArgumentsDone(
                    sequence_number=0, item_id=item.id, output_index=index, arguments=item.arguments
                )
            )
        add(s.OutputItemDone(sequence_number=0, output_index=index, item=item))
    done = final or response(*output)
    add(
        s.ResponseCompleted(sequence_number=0, response=done)
        if done.status == "completed"
        else s.ResponseIncomplete(sequence_number=0, response=done)
    )
    return [
        Event(
            seq, str(type(ev).__struct_config__.tag), s.encoder.encode(msgspec.structs.replace(ev, sequence_number=seq))
        )
        for seq, ev in enumerate(events)
    ]


def parse(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in raw.decode().split("\n\n")[:-1]:
        kind, data = frame.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), frame
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == kind.removeprefix("event: ")
        out.append(event)
    return out


def sdk_events(raw: bytes) -> list[Any]:
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)
    events = [adapter.validate_python(e) for e in parse(raw)]
    for event in events:
        assert_no_extras(event)
    return events


def test_a_stream_is_the_same_whatever_its_batches() -> None:
    log = event_log(REASONING, TEXT, CALL)
    whole = MessageStream(SHAPE).frames(log)
    for cut in itertools.combinations(range(1, len(log)), 2):
        stream = MessageStream(SHAPE)
        pieces = [log[: cut[0]], log[cut[0] : cut[1]], log[cut[1] :]]
        assert b"".join(stream.frames(p) for p in pieces) == whole
    events = sdk_events(whole)
    kinds = [(e.type, e.delta.type if e.type == "content_block_delta" else None) for e in events]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", None),
        ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", None),
        ("content_block_delta", "text_delta"),
        ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", None),
        ("content_block_delta", "input_json_delta"),
        ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert [e.index for e in events if e.type == "content_block_start"] == [0, 1, 2]
    final = events[-2]
    assert (
        final.usage.input_tokens == 10 and final.usage.cache_read_input_tokens == 20 and final.usage.output_tokens == 12
    )


def test_omitted_thinking_streams_only_its_signature_and_failures_are_error_events() -> None:
    hidden = MessageStream(Shape(message_id="m", model="m", display_omitted=True)).frames(event_log(REASONING, TEXT))
    deltas = [e["delta"]["type"] for e in parse(hidden) if e["type"] == "content_block_delta" and e["index"] == 0]
    assert deltas == ["signature_delta"]
    log = event_log(TEXT)[:4]
    failed = response(status="failed", error=s.ResponseError("context_length_exceeded", "too long"))
    log.append(Event(4, "response.failed", s.encoder.encode(s.ResponseFailed(sequence_number=4, response=failed))))
    events = parse(MessageStream(SHAPE).frames(log))
    assert events[-1] == {"type": "error", "error": {"type": "invalid_request_error", "message": "too long"}}
    cut = MessageStream(SHAPE)
    assert (
        parse(cut.frames(event_log(TEXT)[:3]) + cut.cut("server_shutting_down", "shutting down"))[-1]["error"]["type"]
        == "overloaded_error"
    )
