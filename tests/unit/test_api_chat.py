"""A failed chat completion answers the status its error stands for, in OpenAI's envelope; a
refused one names the Chat field the client sent."""

from __future__ import annotations

import json

import msgspec
import pytest

from lmspd.api.chat import failed_error
from lmspd.api.problems import openai_response
from lmspd.chat.params import chat_param, name_chat_fields
from lmspd.chat.schema import ChatCompletionRequest, Message
from lmspd.errors import InvalidRequestError
from lmspd.responses import schema as s


def failed(code: str | None) -> s.Response:
    error = None if code is None else s.ResponseError(code=code, message=f"it failed: {code}")
    return s.Response(id="resp_1", created_at=0, model="m", status="failed", output=[], error=error)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("context_length_exceeded", 400, "invalid_request_error"),
        ("invalid_prompt", 400, "invalid_request_error"),
        ("invalid_request", 400, "invalid_request_error"),
        ("engine_crashed", 500, "server_error"),
        ("server_restarted", 500, "server_error"),
        ("something_new", 500, "server_error"),
        (None, 500, "server_error"),
    ],
)
def test_a_failed_generation_answers_its_errors_status(code: str | None, status: int, kind: str) -> None:
    answer = openai_response(failed_error(failed(code)))
    body = json.loads(bytes(answer.body))
    assert answer.status_code == status
    assert body["error"]["type"] == kind
    assert body["error"]["message"] == (f"it failed: {code}" if code else "the response ended failed")


CHAT = ChatCompletionRequest(
    messages=msgspec.convert(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Call f twice."},
            {
                "role": "assistant",
                "content": "Calling.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{"}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
        list[Message],
    ),
    max_tokens=5,
)


@pytest.mark.parametrize(
    ("param", "chat"),
    [
        ("input", "messages"),
        ("instructions", "messages"),
        ("input[1].content[0].text", "messages[1].content[0].text"),
        ("input[2]", "messages[2]"),  # the assistant's text
        ("input[3].arguments", "messages[2].tool_calls[0].function.arguments"),
        ("input[4].call_id", "messages[2].tool_calls[1].id"),
        ("input[5].output", "messages[3].content"),
        ("input[9]", "messages"),
        ("max_output_tokens", "max_tokens"),
        ("tools[2].parameters.properties", "tools[2].function.parameters.properties"),
        ("tool_choice.name", "tool_choice.function.name"),
        ("text.format.schema.$defs.a", "response_format.json_schema.schema.$defs.a"),
        ("text.format.name", "response_format.json_schema.name"),
        ("text.format", "response_format"),
        ("text.format.type", "response_format.type"),
        ("temperature", "temperature"),
        ("tools[0]", "tools[0]"),
    ],
)
def test_a_responses_field_is_named_as_the_chat_field_it_came_from(param: str, chat: str) -> None:
    assert chat_param(param, CHAT) == chat


def test_an_error_names_the_chat_field_in_its_param_and_its_message() -> None:
    exc = InvalidRequestError("input[3].arguments is not JSON", param="input[3].arguments")
    name_chat_fields(exc, CHAT)
    assert (exc.param, exc.message) == (
        "messages[2].tool_calls[0].function.arguments",
        "messages[2].tool_calls[0].function.arguments is not JSON",
    )
    exc = InvalidRequestError("input[1]: unknown content", param="input[1].content")
    name_chat_fields(exc, CHAT)
    assert (exc.param, exc.message) == ("messages[1].content", "messages[1]: unknown content")
    exc = InvalidRequestError("the input is too long", param="input")
    name_chat_fields(exc, CHAT)
    assert (exc.param, exc.message) == ("messages", "the input is too long")
    exc = InvalidRequestError("text.format.schema: schema has no finite instance", param="text.format.schema.$ref")
    name_chat_fields(exc, CHAT)
    assert (exc.param, exc.message) == (
        "response_format.json_schema.schema.$ref",
        "response_format.json_schema.schema: schema has no finite instance",
    )
