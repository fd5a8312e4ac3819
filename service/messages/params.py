"""A refusal of the Responses request a Messages request runs as, said in Messages' terms.

The core checks the translated request and names its fields: ``input[3].encrypted_content``,
``tools[0].parameters``, ``max_output_tokens``, ``text.format.schema``. A Messages client sent
``messages[2].content[1].signature``, ``tools[4].input_schema``, ``max_tokens`` and
``output_config.format.schema``: :func:`name_messages_fields` renames the error's param, and
the field where its message repeats it. Anthropic's error envelope has no ``param``, so the
message itself starts with the field where it does not name it already. A prompt too long for
the context says so as Anthropic does (``prompt is too long: N tokens > M maximum``), the form
Claude Code reacts to by compacting its history.
"""

from __future__ import annotations

import re
from typing import Literal

from lmspd.errors import ContextLengthExceededError, LmspdError
from lmspd.messages.schema import MessagesBody, Translation
from lmspd.responses.checks import Accepted, accept
from lmspd.responses.schema import TaskRequest

_ITEM = re.compile(r"input\[(\d+)\](?:\.(\w+))?(.*)", re.S)
_TOOL = re.compile(r"tools\[(\d+)\](?:\.(\w+))?(.*)", re.S)
_TOOL_FIELDS = {"parameters": "input_schema"}
_RENAMED = {
    "input": "messages",
    "instructions": "system",
    "max_output_tokens": "max_tokens",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "tool_choice.name": "tool_choice.name",
    "chat_template_kwargs": "thinking",
    "stop": "stop_sequences",
}


def messages_param(param: str, translation: Translation) -> str:
    """``param`` (a field of the core's request) as the Messages field it came from."""
    if param in _RENAMED:
        return _RENAMED[param]
    if (item := _ITEM.fullmatch(param)) is not None:
        index = int(item[1])
        if index >= len(translation.items):
            return "messages"
        origin = translation.items[index]
        if item[2] is None:
            return origin.path
        return f"{origin.path}.{origin.fields.get(item[2], item[2])}{item[3]}"
    if (tool := _TOOL.fullmatch(param)) is not None:
        index = int(tool[1])
        where = f"tools[{translation.tools[index]}]" if index < len(translation.tools) else "tools"
        return where if tool[2] is None else f"{where}.{_TOOL_FIELDS.get(tool[2], tool[2])}{tool[3]}"
    if param == "text" or param.startswith("text."):
        rest = param.removeprefix("text").removeprefix(".format").lstrip(".")
        return f"output_config.format.{rest}" if rest else "output_config.format"
    return param


def prompt_too_long(exc: ContextLengthExceededError) -> str | None:
    """Anthropic's words for a prompt the context cannot take (None: the sizes are not known)."""
    if exc.tokens is None or exc.maximum is None:
        return None
    return f"prompt is too long: {exc.tokens} tokens > {exc.maximum} maximum"


def name_messages_fields(exc: LmspdError, translation: Translation | None) -> None:
    """Rename ``exc``'s param (and the same path in its message) to the Messages field, in
    place; the message starts with the field where it does not say it."""
    if isinstance(exc, ContextLengthExceededError) and (said := prompt_too_long(exc)) is not None:
        _set(exc, said, "messages")
        return
    if exc.param is None:
        return
    renamed = messages_param(exc.param, translation) if translation is not None else exc.param
    message = exc.message
    if renamed != exc.param and any(c in exc.param for c in ".[_"):  # "input" alone is also a word
        message = message.replace(exc.param, renamed)
        if (item := _ITEM.fullmatch(exc.param)) is not None and translation is not None:
            message = message.replace(f"input[{item[1]}]", messages_param(f"input[{item[1]}]", translation))
    parent = renamed.rpartition(".")[0]
    if renamed not in message and not (parent and message.startswith(f"{parent}:")):
        message = f"{renamed}: {message}"
    _set(exc, message, renamed)


def _set(exc: LmspdError, message: str, param: str) -> None:
    exc.message = message
    exc.args = (message,)
    exc.param = param


def translate(
    body: MessagesBody, hosted_tools: Literal["refuse", "omit"] = "refuse"
) -> tuple[Translation, Accepted[TaskRequest]]:
    """``body`` translated and its core request accepted (for intake to carry): every refusal
    names the Messages field (what the core checks later, at intake, is renamed with the
    translation too)."""
    try:
        translation = body.translate(hosted_tools=hosted_tools)
    except LmspdError as exc:
        name_messages_fields(exc, None)
        raise
    try:
        accepted = accept(translation.request)
    except LmspdError as exc:
        name_messages_fields(exc, translation)
        raise
    return translation, accepted
