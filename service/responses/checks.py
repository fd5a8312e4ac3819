"""Intake's checks of a decoded Responses request: decoding checked its shape; :func:`accept`
checks the values and the features not served yet, leaves hosted tools out where the server says
so (``[responses] hosted_tools = "omit"``), and parses the directives (tools, tool_choice, text,
reasoning) once. Pure: the request decoded is never changed; what runs is :attr:`Accepted.request`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec

from lmspd.engine.protocol import validate_top_logprobs
from lmspd.errors import InvalidRequestError
from lmspd.models.tokenizer import TEMPLATE_ARGUMENTS
from lmspd.responses.inputs import parse_items
from lmspd.responses.schema import (
    DIRECTIVE_FIELDS,
    INCLUDES,
    MAX_CLIENT_METADATA_CHARS,
    MAX_CLIENT_METADATA_KEYS,
    MAX_TOKENS,
    ResponseRequest,
    TaskRequest,
    directives_of,
)
from lmspd.responses.tools import Directives, omit_hosted

R = TypeVar("R", bound=ResponseRequest)
# An Accepted[TaskRequest] is an Accepted[ResponseRequest]: it is read, never written.
R_co = TypeVar("R_co", bound=ResponseRequest, covariant=True)


@dataclass(frozen=True)
class Accepted(Generic[R_co]):
    """A request intake accepts: as it runs, its parsed directives, and the hosted tool types
    left out of it (the response names them, docs/responses.md, "Coding agents")."""

    request: R_co
    directives: Directives
    omitted_tools: tuple[str, ...] = ()

    def replace(self, **changes: Any) -> Accepted[R_co]:
        """The request with ``changes`` to fields the directives are not parsed from (its input
        resolved, its includes): the directives carried as they are, never parsed again."""
        _outside_directives(changes)
        return Accepted(msgspec.structs.replace(self.request, **changes), self.directives, self.omitted_tools)

    def task(self, **extra: Any) -> Accepted[TaskRequest]:
        """As the task request that runs it (:meth:`TaskRequest.of`), ``extra`` its own fields."""
        _outside_directives(extra)
        return Accepted(TaskRequest.of(self.request, **extra), self.directives, self.omitted_tools)


def _outside_directives(changes: dict[str, Any]) -> None:
    if parsed := DIRECTIVE_FIELDS & changes.keys():
        raise ValueError(f"{sorted(parsed)} would change the directives: accept the new request")


def accept(request: R, *, hosted_tools: Literal["refuse", "omit"] = "refuse") -> Accepted[R]:
    """``hosted_tools``: the server's ``[responses] hosted_tools``: "omit" takes hosted tools out
    of ``tools`` (before anything reads them: the stored request has none)."""
    omitted: list[str] = []
    if hosted_tools == "omit":
        kept, omitted = omit_hosted(request.tools)
        if omitted:
            request = msgspec.structs.replace(request, tools=kept)
    _check_values(request)
    return Accepted(request, directives_of(request), tuple(omitted))


def _check_values(request: ResponseRequest) -> None:
    if isinstance(request.input, list):
        if not request.input:
            raise InvalidRequestError("input must not be empty", param="input")
        parse_items(request.input)
    if request.max_output_tokens is not None and not 1 <= request.max_output_tokens <= MAX_TOKENS:
        raise InvalidRequestError(f"max_output_tokens must be from 1 to {MAX_TOKENS}", param="max_output_tokens")
    if request.metadata is not None:
        if len(request.metadata) > 16:
            raise InvalidRequestError("metadata has more than 16 keys", param="metadata")
        for k, v in request.metadata.items():
            if len(k) > 64 or len(v) > 512:
                raise InvalidRequestError("metadata keys are at most 64 and values 512 characters", param="metadata")
    if request.client_metadata is not None:
        if len(request.client_metadata) > MAX_CLIENT_METADATA_KEYS:
            raise InvalidRequestError(
                f"client_metadata has more than {MAX_CLIENT_METADATA_KEYS} keys", param="client_metadata"
            )
        size = sum(len(k) + len(v) for k, v in request.client_metadata.items())
        if size > MAX_CLIENT_METADATA_CHARS:
            raise InvalidRequestError(
                f"client_metadata holds more than {MAX_CLIENT_METADATA_CHARS} characters", param="client_metadata"
            )
    if request.truncation not in (None, "disabled"):
        raise InvalidRequestError("truncation must be 'disabled'", param="truncation")
    validate_top_logprobs(request.top_logprobs)
    for i, value in enumerate(request.include or []):
        if value not in INCLUDES:
            raise InvalidRequestError(
                f"include value {value!r} is not available here (only {' and '.join(map(repr, sorted(INCLUDES)))})",
                param=f"include[{i}]",
            )
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0):
            raise InvalidRequestError(f"{name} is not supported: only 0", param=name)
    if request.prompt is not None:
        raise InvalidRequestError("stored prompt templates are not available on a local server", param="prompt")
    if request.max_tool_calls is not None and not 1 <= request.max_tool_calls <= MAX_TOKENS:
        raise InvalidRequestError(f"max_tool_calls must be from 1 to {MAX_TOKENS}", param="max_tool_calls")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options needs stream: true", param="stream_options")
    if request.conversation is not None:
        if request.previous_response_id is not None:
            raise InvalidRequestError(
                "previous_response_id and conversation are mutually exclusive", param="conversation"
            )
        if not request.conversation_id:
            raise InvalidRequestError("conversation must be an id or {'id': ...}", param="conversation")
    request.compact_threshold()  # validates context_management
    if reserved := TEMPLATE_ARGUMENTS & set(request.chat_template_kwargs or {}):
        raise InvalidRequestError(f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
    if request.background and request.stream:
        raise InvalidRequestError("background and stream cannot be combined", param="stream")
