"""The Chat Completions view: request decoding and translation, completions and chunk streams.

Pure translation (no HTTP, no DB). Produced objects are also validated against the
openai SDK's own pydantic models, extra keys included, so the official client parses them.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Literal

import msgspec
import pytest
from openai.types.chat import ChatCompletion as SdkCompletion
from openai.types.chat import ChatCompletionChunk as SdkChunk

from harness.openresponses import assert_no_extras
from lmspd.api.wire import decode
from lmspd.chat.schema import ChatCompletionRequest
from lmspd.chat.view import ChunkStream, completion, done
from lmspd.errors import InvalidRequestError
from lmspd.responses import schema as s
from lmspd.responses.inputs import parse_items, to_messages
from lmspd.store.task_store import Event

# --- helpers --------------------------------------------------------------------------------


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode(json.dumps(body).encode(), ChatCompletionRequest)


def rejected(**fields: Any) -> str | None:
    with pytest.raises(InvalidRequestError) as info:
        request(**fields).to_response_request()
    return info.value.param


def sdk_completion(obj: msgspec.Struct) -> SdkCompletion:
    parsed = SdkCompletion.model_validate(msgspec.to_builtins(obj))
    assert_no_extras(parsed)
    return parsed


def parse_frames(raw: bytes) -> list[dict[str, Any]]:
    assert raw.endswith(b"\n\n")
    out = []
    for frame in raw.decode().split("\n\n")[:-1]:
        assert frame.startswith("data: "), frame
        out.append(json.loads(frame.removeprefix("data: ")))
    return out


def sdk_chunks(raw: bytes) -> list[SdkChunk]:
    chunks = [SdkChunk.model_validate(frame) for frame in parse_frames(raw)]
    for chunk in chunks:
        assert_no_extras(chunk)
    return chunks


# --- requests -------------------------------------------------------------------------------

EVERY_FIELD: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi", "name": "ann"}],
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {},
    "logprobs": True,
    "top_logprobs": 3,
    "max_tokens": 10,
    "max_completion_tokens": 20,
    "n": 1,
    "stop": ["\n\n", "END"],
    "stream": True,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
    "temperature": 0.2,
    "top_p": 0.9,
    "seed": 7,
    "user": "u-1",
    "service_tier": "auto",
    "metadata": {"k": "v"},
    "store": True,
    "parallel_tool_calls": True,
    "tools": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "prompt_cache_key": "pck",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "safety_identifier": "sid",
    "reasoning_effort": "low",
    "verbosity": "medium",
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "moderation": None,
    "functions": [],
    "function_call": "none",
}


def test_every_documented_field_decodes_and_translates() -> None:
    req = decode(json.dumps(EVERY_FIELD).encode(), ChatCompletionRequest)
    assert req.include_usage
    accepted, extras = req.to_response_request()
    rr = accepted.request
    assert rr.model == "m"
    assert rr.input == [{"role": "user", "content": "hi"}]
    assert rr.max_output_tokens == 20  # max_completion_tokens wins over the deprecated max_tokens
    assert (rr.temperature, rr.top_p, rr.metadata) == (0.2, 0.9, {"k": "v"})
    assert rr.store is False and rr.stream is True and rr.background is False
    assert (rr.safety_identifier, rr.prompt_cache_key, rr.instructions) == ("sid", "pck", None)
    assert (extras.stop, extras.seed, extras.logprobs) == (["\n\n", "END"], 7, 3)


def test_defaults_translate_to_a_plain_request() -> None:
    accepted, extras = request(max_tokens=5).to_response_request()
    rr = accepted.request
    assert rr.max_output_tokens == 5 and rr.stream is None and rr.store is False
    assert (extras.stop, extras.seed, extras.logprobs) == ([], None, None)
    assert not request(stream_options={"include_usage": True}).include_usage  # not streaming


def test_stop_string_and_logprobs_without_top() -> None:
    _, extras = request(stop="###", logprobs=True).to_response_request()
    assert extras.stop == ["###"] and extras.logprobs == 0
    _, extras = request(logprobs=False).to_response_request()
    assert extras.logprobs is None


def test_an_unknown_field_names_itself() -> None:
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        msgspec.json.decode(b'{"messages": [], "bogus": 1}', type=ChatCompletionRequest)
    with pytest.raises(InvalidRequestError) as info:
        request(bogus=1)
    assert info.value.param == "bogus"
    with pytest.raises(InvalidRequestError) as info:
        request(messages=[{"role": "user", "content": "x", "extra": 1}])
    assert info.value.param == "messages[0].extra"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "name": "f"}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"messages": []}, "messages"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_rejections_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert rejected(**fields) == param


def test_sampling_ranges_are_left_to_the_core() -> None:
    accepted, _ = request(temperature=5.0, top_p=0.0).to_response_request()
    rr = accepted.request
    assert (rr.temperature, rr.top_p) == (5.0, 0.0)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
)
def test_a_non_text_part_is_rejected_by_its_type(part: dict[str, Any]) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [part]}]
    assert rejected(messages=messages) == "messages[1].content[0].type"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "assistant"}, "messages[0].content"),
        ({"role": "assistant", "content": None}, "messages[0].content"),
        ({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, "messages[0].function_call"),
        ({"role": "assistant", "content": "x", "audio": {"id": "a1"}}, "messages[0].audio"),
        ({"role": "function", "name": "f", "content": "r"}, "messages[0].role"),
    ],
)
def test_message_rejections(message: dict[str, Any], param: str) -> None:
    assert rejected(messages=[message]) == param


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "narrator", "content": "x"}, "messages[0].role"),
        (
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            "messages[0].content[0].type",
        ),
        ({"role": "tool", "content": "x"}, "messages[0]"),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]},
            "messages[0].tool_calls[0].type",
        ),
    ],
)
def test_malformed_messages_fail_decoding_with_the_path(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request(messages=[message])
    assert info.value.param == param


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "developer", "content": [{"type": "text", "text": "Use metric."}]},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    {"role": "assistant", "content": "18C at noon.", "name": "bot"},
    {"role": "user", "content": "And tomorrow?", "name": "ann"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"id": "call_3", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
    },
    {"role": "tool", "tool_call_id": "call_3", "content": "20C"},
    {"role": "assistant", "content": [{"type": "text", "text": "20C."}], "refusal": None},
    {"role": "assistant", "content": None, "refusal": "I can't."},
]


def test_a_multi_turn_conversation_becomes_items_the_core_renders() -> None:
    accepted, _ = request(messages=CONVERSATION).to_response_request()
    rr = accepted.request
    assert rr.input == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "input_text", "text": "Use metric."}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
        {"role": "assistant", "content": "18C at noon."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "call_3", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_3", "output": "20C"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "20C."}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
    ]
    items = parse_items(rr.input if isinstance(rr.input, list) else [])
    rendered = to_messages(items, native_tools=True)
    assert [(m["role"], m["content"]) for m in rendered] == [
        ("system", "Be brief."),
        ("system", "Use metric."),
        ("user", "Weather in Paris?"),
        ("assistant", ""),
        ("tool", "18C"),
        ("tool", "noon"),
        ("assistant", "18C at noon."),
        ("user", "And tomorrow?"),
        ("assistant", "Checking."),
        ("tool", "20C"),
        ("assistant", "20C."),
        ("assistant", "I can't."),
    ]
    calls = [[(c["id"], c["function"]["name"]) for c in m["tool_calls"]] for m in rendered if "tool_calls" in m]
    assert calls == [[("call_1", "weather"), ("call_2", "time")], [("call_3", "weather")]]
    # A template that ignores tools reads calls and results in the Hermes format lmspd teaches it.
    hermes = to_messages(items)
    assert hermes[3]["content"] == (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
    )
    assert hermes[4] == {
        "role": "user",
        "content": "<tool_response>\n18C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>",
    }


def test_an_empty_assistant_turn_stays_a_message() -> None:
    accepted, _ = request(
        messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]
    ).to_response_request()
    rr = accepted.request
    assert rr.input == [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]


# --- completions ----------------------------------------------------------------------------

LOGPROBS = [
    {
        "token": "Hel",
        "logprob": -0.1,
        "bytes": [72, 101, 108],
        "top_logprobs": [
            {"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108]},
            {"token": "Hi", "logprob": -2.5, "bytes": [72, 105]},
        ],
    },
    {"token": "lo", "logprob": -0.01, "bytes": [108, 111], "top_logprobs": []},
]


def response(status: s.ResponseStatus, text: str = "Hello", **fields: Any) -> s.Response:
    item_status: Literal["completed", "incomplete"] = "completed" if status == "completed" else "incomplete"
    part = s.OutputText(text=text, logprobs=fields.pop("logprobs", []))
    return s.Response(
        id="resp_1",
        created_at=100,
        status=status,
        model="smol",
        output=[s.OutputMessage(id="msg_1", status=item_status, content=[part])] if text else [],
        usage=s.Usage(input_tokens=12, output_tokens=3, total_tokens=15, input_tokens_details=s.InputTokensDetails(4)),
        **fields,
    )


def test_a_completed_response_is_a_chat_completion() -> None:
    chat = completion(response("completed"), completion_id="chatcmpl-1", created=123)
    parsed = sdk_completion(chat)
    assert (parsed.id, parsed.object, parsed.created, parsed.model) == ("chatcmpl-1", "chat.completion", 123, "smol")
    [choice] = parsed.choices
    assert (choice.index, choice.finish_reason, choice.logprobs) == (0, "stop", None)
    assert (choice.message.role, choice.message.content, choice.message.refusal) == ("assistant", "Hello", None)
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (12, 3, 15)
    assert parsed.usage.prompt_tokens_details and parsed.usage.prompt_tokens_details.cached_tokens == 4
    assert parsed.usage.completion_tokens_details and parsed.usage.completion_tokens_details.reasoning_tokens == 0
    raw = msgspec.to_builtins(chat)
    assert raw["system_fingerprint"] is None and raw["service_tier"] == "default"
    assert raw["choices"][0]["logprobs"] is None


def test_an_incomplete_response_finishes_with_length() -> None:
    r = response("incomplete", "Hel", incomplete_details=s.IncompleteDetails("max_output_tokens"), max_output_tokens=3)
    [choice] = sdk_completion(completion(r, completion_id="chatcmpl-2", created=1)).choices
    assert (choice.finish_reason, choice.message.content) == ("length", "Hel")


def test_a_cancelled_or_empty_response_stops() -> None:
    [choice] = sdk_completion(completion(response("cancelled", ""), completion_id="c", created=1)).choices
    assert (choice.finish_reason, choice.message.content) == ("stop", "")


def test_logprobs_map_to_openai_entries() -> None:
    chat = completion(response("completed", logprobs=LOGPROBS), completion_id="c", created=1)
    [choice] = sdk_completion(chat).choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    first, second = choice.logprobs.content
    assert (first.token, first.logprob, first.bytes) == ("Hel", -0.1, [72, 101, 108])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("Hel", -0.1), ("Hi", -2.5)]
    assert (second.token, second.top_logprobs) == ("lo", [])
    assert msgspec.to_builtins(chat)["choices"][0]["logprobs"] == {"content": LOGPROBS, "refusal": None}


# --- chunk streams --------------------------------------------------------------------------


def row(event: s._Event) -> Event:
    return Event(event.sequence_number, str(type(event).__struct_config__.tag), s.encoder.encode(event))


DELTAS = ["Hel", "lo", ", wor", "ld"]


def event_log(
    final: str = "completed",
    deltas: list[str] = DELTAS,
    logprobs: bool = False,
    error: s.ResponseError | None = None,
) -> list[Event]:
    text = "".join(deltas)
    base = s.Response(id="resp_1", created_at=100, status="queued", model="smol", store=False, background=False)
    running = msgspec.structs.replace(base, status="in_progress")
    item = s.OutputMessage(id="msg_1", status="in_progress")
    events: list[s._Event] = [
        s.ResponseCreated(sequence_number=0, response=base),
        s.ResponseInProgress(sequence_number=1, response=running),
        s.OutputItemAdded(sequence_number=2, output_index=0, item=item),
        s.ContentPartAdded(sequence_number=3, item_id="msg_1", output_index=0, content_index=0, part=s.OutputText("")),
    ]
    for delta in deltas:
        lp = [s.LogProb(token=delta, logprob=-0.5, bytes=list(delta.encode()), top_logprobs=[])] if logprobs else []
        events.append(
            s.OutputTextDelta(
                sequence_number=len(events), item_id="msg_1", output_index=0, content_index=0, delta=delta, logprobs=lp
            )
        )
    part = s.OutputText(text)
    done_item = s.OutputMessage(id="msg_1", status="completed", content=[part])
    events += [
        s.OutputTextDone(sequence_number=len(events), item_id="msg_1", output_index=0, content_index=0, text=text),
        s.ContentPartDone(sequence_number=len(events) + 1, item_id="msg_1", output_index=0, content_index=0, part=part),
        s.OutputItemDone(sequence_number=len(events) + 2, output_index=0, item=done_item),
    ]
    usage = s.Usage(input_tokens=9, output_tokens=len(deltas), total_tokens=9 + len(deltas))
    finished = msgspec.structs.replace(running, output=[done_item], usage=usage)
    seq = len(events)
    if final == "completed":
        events.append(
            s.ResponseCompleted(sequence_number=seq, response=msgspec.structs.replace(finished, status="completed"))
        )
    elif final == "incomplete":
        details = s.IncompleteDetails("max_output_tokens")
        events.append(
            s.ResponseIncomplete(
                sequence_number=seq,
                response=msgspec.structs.replace(finished, status="incomplete", incomplete_details=details),
            )
        )
    elif final == "cancelled":
        events.append(
            s.ResponseCancelled(sequence_number=seq, response=msgspec.structs.replace(finished, status="cancelled"))
        )
    else:
        error = error or s.ResponseError("engine_crashed", "the engine process died")
        events.append(
            s.ResponseFailed(
                sequence_number=seq, response=msgspec.structs.replace(finished, status="failed", error=error)
            )
        )
    return [row(e) for e in events]


def stream(log: list[Event], *, include_usage: bool = False, batches: list[int] | None = None) -> bytes:
    """Run the log through a fresh ChunkStream, split at the given boundaries."""
    chunks = ChunkStream("chatcmpl-9", "smol", 123, include_usage=include_usage)
    cuts = [0, *(batches or []), len(log)]
    return b"".join(chunks.frames(log[a:b]) for a, b in itertools.pairwise(cuts))


def test_a_stream_is_role_then_deltas_then_finish() -> None:
    raw = stream(event_log())
    chunks = sdk_chunks(raw)
    assert all(
        (c.id, c.object, c.created, c.model) == ("chatcmpl-9", "chat.completion.chunk", 123, "smol") for c in chunks
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert [c.choices[0].delta.content for c in chunks[1:-1]] == DELTAS
    assert all(c.choices[0].finish_reason is None and c.choices[0].logprobs is None for c in chunks[:-1])
    last = chunks[-1].choices[0]
    assert (last.finish_reason, last.delta.content, last.delta.role) == ("stop", None, None)
    frames = parse_frames(raw)
    assert frames[-1]["choices"][0]["delta"] == {}
    assert all("usage" not in f for f in frames)  # no usage key at all unless include_usage
    assert done() == b"data: [DONE]\n\n" and ChunkStream("c", "m", 1).done() == done()


def test_every_batch_split_gives_the_same_frames() -> None:
    log = event_log(logprobs=True)
    whole = stream(log, include_usage=True)
    for cut in range(len(log) + 1):
        assert stream(log, include_usage=True, batches=[cut]) == whole
    assert stream(log, include_usage=True, batches=list(range(1, len(log)))) == whole
    assert stream(log, include_usage=True, batches=[2, 5, 7, 11]) == whole


def test_include_usage_adds_a_usage_chunk_and_null_usage_everywhere_else() -> None:
    raw = stream(event_log(), include_usage=True)
    frames = parse_frames(raw)
    assert all(f["usage"] is None for f in frames[:-1])
    assert frames[-1]["choices"] == []
    assert frames[-1]["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    chunks = sdk_chunks(raw)
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 13


def test_delta_logprobs_travel_with_their_chunk() -> None:
    chunks = sdk_chunks(stream(event_log(logprobs=True)))
    content = [c.choices[0].logprobs.content for c in chunks[1:-1] if c.choices[0].logprobs]
    assert [[(t.token, t.logprob) for t in entries or []] for entries in content] == [[(d, -0.5)] for d in DELTAS]


@pytest.mark.parametrize(("final", "reason"), [("incomplete", "length"), ("cancelled", "stop")])
def test_other_endings(final: str, reason: str) -> None:
    chunks = sdk_chunks(stream(event_log(final), include_usage=True))
    assert chunks[-2].choices[0].finish_reason == reason and chunks[-1].choices == []


def test_a_failed_response_ends_with_an_error_frame() -> None:
    frames = parse_frames(stream(event_log("failed"), include_usage=True))
    assert frames[-1] == {
        "error": {"message": "the engine process died", "type": "server_error", "param": None, "code": "engine_crashed"}
    }
    assert all(f["choices"][0]["finish_reason"] is None for f in frames[:-1])
    sdk_chunks(b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames[:-1]))


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("context_length_exceeded", "invalid_request_error"),
        ("engine_crashed", "server_error"),
        ("something_new", "server_error"),
    ],
)
def test_the_error_frame_is_typed_as_its_code(code: str, kind: str) -> None:
    """As the same failure answers without streaming (tests/unit/test_api_chat.py)."""
    frames = parse_frames(stream(event_log("failed", error=s.ResponseError(code, "it failed"))))
    assert frames[-1] == {"error": {"message": "it failed", "type": kind, "param": None, "code": code}}


def test_a_restart_before_any_text_is_invisible() -> None:
    log = event_log()
    restart = row(s.AttemptRestarted(sequence_number=99, attempt=2, reason="engine_crashed"))
    with_restart = stream([*log[:3], restart, *log[3:]])
    assert with_restart == stream(log)


def test_a_restart_after_text_ends_the_stream_with_an_error() -> None:
    log = event_log()
    restart = row(s.AttemptRestarted(sequence_number=99, attempt=2, reason="engine_crashed"))
    chunks = ChunkStream("c", "m", 1)
    first = chunks.frames([*log[:6], restart])
    assert chunks.finished and chunks.frames(log[6:]) == b""
    frames = parse_frames(first)
    assert [f["choices"][0]["delta"].get("content") for f in frames[:-1]] == ["", "Hel", "lo"]
    assert frames[-1]["error"]["code"] == "attempt_restarted"


def test_events_without_a_chat_equivalent_are_skipped_undecoded() -> None:
    log = event_log()
    future = Event(4, "response.reasoning_text.delta", b'{"not": "a known event"}')
    assert stream([*log[:4], future, *log[4:]]) == stream(log)


def test_nothing_after_the_final_event() -> None:
    log = event_log()
    chunks = ChunkStream("c", "m", 1)
    chunks.frames(log)
    assert chunks.finished and chunks.frames(log) == b""
    assert ChunkStream("c", "m", 1).frames([]) == b""
