"""A Responses error's ``param`` in Chat Completions' own fields.

A chat request runs as the :class:`~lmspd.responses.schema.ResponseRequest` it translates to,
so the checks that refuse it (the prompt too long for the context, a tool's schema, the
sampling ranges) name the Responses fields: ``input``, ``input[3].arguments``,
``max_output_tokens``, ``text.format.schema``, ``tools[0].parameters``. A Chat client sent
``messages``, ``messages[2].tool_calls[0].function.arguments``, ``max_tokens``,
``response_format.json_schema.schema`` and ``tools[0].function.parameters``:
:func:`name_chat_fields` renames the error's param (and the field where its message repeats
it) to the field the client sent.
"""

from __future__ import annotations

import re

from lmspd.chat.schema import ChatCompletionRequest
from lmspd.errors import LmspdError

# Fields of a Responses item and where its Chat message has them.
_CALL_FIELDS = {"name": "function.name", "arguments": "function.arguments", "call_id": "id"}
_OUTPUT_FIELDS = {"output": "content", "call_id": "tool_call_id"}
_ITEM = re.compile(r"input\[(\d+)\](?:\.(\w+))?(.*)", re.S)
_TOOL = re.compile(r"tools\[(\d+)\]\.(name|description|parameters|strict)(.*)", re.S)
_JSON_SCHEMA_FIELDS = ("name", "description", "schema", "strict")


def item_paths(chat: ChatCompletionRequest) -> list[tuple[str, dict[str, str]]]:
    """For each Responses input item the messages become (in order), the Chat path it came
    from and how that item's fields are named there."""
    paths: list[tuple[str, dict[str, str]]] = []
    for m, message in enumerate(chat.messages):
        calls = 0
        for item in message.items():
            if item.get("type") == "function_call":
                paths.append((f"messages[{m}].tool_calls[{calls}]", _CALL_FIELDS))
                calls += 1
            else:
                paths.append((f"messages[{m}]", _OUTPUT_FIELDS if item.get("type") == "function_call_output" else {}))
    return paths


def chat_param(param: str, chat: ChatCompletionRequest) -> str:
    """``param`` (a Responses request's field) as the field of ``chat`` it came from."""
    if param in ("input", "instructions"):
        return "messages"
    if param == "max_output_tokens":
        return "max_completion_tokens" if chat.max_completion_tokens is not None else "max_tokens"
    if (item := _ITEM.fullmatch(param)) is not None:
        paths = item_paths(chat)
        index = int(item[1])
        if index >= len(paths):
            return "messages"
        prefix, fields = paths[index]
        return prefix if item[2] is None else f"{prefix}.{fields.get(item[2], item[2])}{item[3]}"
    if (tool := _TOOL.fullmatch(param)) is not None:
        return f"tools[{tool[1]}].function.{tool[2]}{tool[3]}"
    if param == "tool_choice.name":
        return "tool_choice.function.name"
    if param == "text" or param.startswith("text."):
        rest = param.removeprefix("text").removeprefix(".format").lstrip(".")
        field = rest.split(".", 1)[0].split("[", 1)[0]
        if field in _JSON_SCHEMA_FIELDS:
            return f"response_format.json_schema.{rest}"
        return f"response_format.{rest}" if rest else "response_format"
    return param


def name_chat_fields(exc: LmspdError, chat: ChatCompletionRequest) -> None:
    """Rename ``exc``'s param (and the same path in its message) to Chat's field, in place."""
    if exc.param is None:
        return
    renamed = chat_param(exc.param, chat)
    if renamed == exc.param:
        return
    # Only a path is repeated in the message as a field: "input" is also a word.
    if any(c in exc.param for c in ".[_"):
        message = exc.message.replace(exc.param, renamed)
        head, colon, rest = message.partition(": ")  # "text.format.schema: ..." names a field too
        if colon and exc.param.startswith(head) and any(c in head for c in ".[_"):
            message = f"{chat_param(head, chat)}: {rest}"
        if (item := _ITEM.fullmatch(exc.param)) is not None:  # "input[3]: ..." names the item
            message = message.replace(f"input[{item[1]}]", chat_param(f"input[{item[1]}]", chat))
        exc.message = message
        exc.args = (message,)
    exc.param = renamed
