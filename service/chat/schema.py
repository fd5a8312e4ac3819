"""A Chat Completions request and its translation into the Responses request the core runs.

Every field OpenAI documents for ``POST /v1/chat/completions`` decodes (unknown ones
are rejected, so nothing a client sends is silently ignored). :meth:`ChatCompletionRequest.validate`
then rejects the values that would change the result but cannot be honoured here;
fields that change nothing for a local model (``user``, ``service_tier``, cache hints,
``verbosity``, ``reasoning_effort``, ...) are accepted and dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal, NoReturn

import msgspec

from lmspd.errors import InvalidRequestError
from lmspd.responses.checks import Accepted, accept
from lmspd.responses.schema import MAX_TOKENS, ResponseRequest
from lmspd.responses.tools import text_param

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20

# --- content parts --------------------------------------------------------------------------


class _Part(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    pass


class TextPart(_Part, tag="text"):
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a cache hint: changes no output


class RefusalPart(_Part, tag="refusal"):
    refusal: str


# Non-text parts decode (they are OpenAI's) so validate() can name them in a clear 400.
class ImageUrlPart(_Part, tag="image_url"):
    image_url: dict[str, Any]


class InputAudioPart(_Part, tag="input_audio"):
    input_audio: dict[str, Any]


class FilePart(_Part, tag="file"):
    file: dict[str, Any]


UserPart = TextPart | ImageUrlPart | InputAudioPart | FilePart
AssistantPart = TextPart | RefusalPart


def _tag(obj: msgspec.Struct) -> str:
    return str(type(obj).__struct_config__.tag)


def _input_content(content: str | Sequence[_Part]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [{"type": "input_text", "text": p.text} for p in content if isinstance(p, TextPart)]


def _check_text_only(content: str | Sequence[_Part], where: str) -> None:
    if isinstance(content, str):
        return
    for j, part in enumerate(content):
        if not isinstance(part, TextPart):
            raise InvalidRequestError(
                f"{where}.content[{j}]: content type '{_tag(part)}' is not supported: lmspd serves text models",
                param=f"{where}.content[{j}].type",
            )


# --- messages -------------------------------------------------------------------------------


class _Message(msgspec.Struct, tag_field="role", forbid_unknown_fields=True, kw_only=True):
    """What each message (the ``Message`` union below) offers: ``check``, and ``items``, its
    Responses input items (as ``lmspd.responses.inputs.parse_items`` accepts), which each
    message class supplies (msgspec's metaclass leaves no room for an ``abc.ABC`` here)."""

    def check(self, where: str) -> None:
        """Raise InvalidRequestError for what decodes but cannot be honoured."""


class SystemMessage(_Message, tag="system"):
    content: str | list[TextPart]
    name: str | None = None  # accepted; the chat templates have no place for it

    def items(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": _input_content(self.content)}]


class DeveloperMessage(_Message, tag="developer"):
    content: str | list[TextPart]
    name: str | None = None

    def items(self) -> list[dict[str, Any]]:
        return [{"role": "developer", "content": _input_content(self.content)}]


class UserMessage(_Message, tag="user"):
    content: str | list[UserPart]
    name: str | None = None

    def check(self, where: str) -> None:
        _check_text_only(self.content, where)

    def items(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": _input_content(self.content)}]


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Message, tag="assistant"):
    content: str | list[AssistantPart] | None = None
    refusal: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # deprecated by tool_calls
    audio: dict[str, Any] | None = None

    def check(self, where: str) -> None:
        if self.function_call is not None:
            raise InvalidRequestError(
                f"{where}.function_call is not supported: send tool_calls", param=f"{where}.function_call"
            )
        if self.content is None and self.refusal is None and not self.tool_calls:
            raise InvalidRequestError(f"{where}.content is required unless tool_calls is set", param=f"{where}.content")
        if self.audio is not None:
            raise InvalidRequestError(f"{where}.audio is not supported", param=f"{where}.audio")

    def items(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        content = self._content()
        # A pure tool-call turn (content null or "") is carried by its function_call items alone.
        if content or not self.tool_calls:
            out.append({"role": "assistant", "content": content})
        for call in self.tool_calls or []:
            out.append(
                {
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.function.name,
                    "arguments": call.function.arguments,
                }
            )
        return out

    def _content(self) -> str | list[dict[str, Any]]:
        if self.refusal is None and (self.content is None or isinstance(self.content, str)):
            return self.content or ""
        parts: list[dict[str, Any]] = []
        if isinstance(self.content, str) and self.content:
            parts.append({"type": "output_text", "text": self.content})
        for part in self.content if isinstance(self.content, list) else []:
            if isinstance(part, TextPart):
                parts.append({"type": "output_text", "text": part.text})
            else:
                parts.append({"type": "refusal", "refusal": part.refusal})
        if self.refusal:
            parts.append({"type": "refusal", "refusal": self.refusal})
        return parts


class ToolMessage(_Message, tag="tool"):
    content: str | list[TextPart]
    tool_call_id: str

    def items(self) -> list[dict[str, Any]]:
        output = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return [{"type": "function_call_output", "call_id": self.tool_call_id, "output": output}]


class FunctionMessage(_Message, tag="function"):
    """The deprecated ``functions`` API's result message: decodes, then is refused."""

    name: str
    content: str | None = None

    def check(self, where: str) -> NoReturn:
        raise InvalidRequestError(
            f"{where}: role 'function' is not supported: send tool messages", param=f"{where}.role"
        )

    def items(self) -> list[dict[str, Any]]:
        """None: ``check`` refuses the message before its items are asked for."""
        self.check("messages")


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage


# --- the request ----------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = None
    # Obfuscation pads chunks against a network side channel; we add no padding, and
    # leaving it out changes no content.
    include_obfuscation: bool | None = None


class ChatExtras(msgspec.Struct, frozen=True, kw_only=True):
    """What a chat request asks of generation that a ResponseRequest cannot carry."""

    stop: list[str] = []
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; else how many top alternatives per token


class ChatCompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    messages: list[Message]
    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, int] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    user: str | None = None
    service_tier: str | None = None  # echoed as "default"
    metadata: dict[str, str] | None = None
    store: bool | None = None  # chat completions are never stored here
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field that cannot be honoured.
        Sampling ranges (temperature, top_p) are the core's to check."""
        for param, why in self._unsupported():
            raise InvalidRequestError(why, param=param)
        self._check_values()
        for i, message in enumerate(self.messages):
            message.check(f"messages[{i}]")

    def _unsupported(self) -> Iterator[tuple[str, str]]:
        if self.n not in (None, 1):
            yield "n", "n must be 1: one choice per completion"
        if self.frequency_penalty not in (None, 0):
            yield "frequency_penalty", "frequency_penalty is not supported"
        if self.presence_penalty not in (None, 0):
            yield "presence_penalty", "presence_penalty is not supported"
        if self.logit_bias:
            yield "logit_bias", "logit_bias is not supported"
        if self.functions:
            yield "functions", "functions (deprecated) are not supported: send tools"
        if self.function_call not in (None, "none"):
            yield "function_call", "function_call (deprecated) is not supported: send tool_choice"
        if self.modalities not in (None, ["text"]):
            yield "modalities", "only modalities ['text'] is supported"
        for param, value in (
            ("audio", self.audio),
            ("prediction", self.prediction),
            ("web_search_options", self.web_search_options),
            ("moderation", self.moderation),
        ):
            if value is not None:
                yield param, f"{param} is not supported"

    def _check_values(self) -> None:
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        for param, value in (("max_tokens", self.max_tokens), ("max_completion_tokens", self.max_completion_tokens)):
            if value is not None and not 1 <= value <= MAX_TOKENS:
                raise InvalidRequestError(f"{param} must be from 1 to {MAX_TOKENS}", param=param)
        if len(self.stop_sequences) > MAX_STOP:
            raise InvalidRequestError(f"stop has more than {MAX_STOP} sequences", param="stop")
        if "" in self.stop_sequences:
            raise InvalidRequestError("stop sequences must not be empty", param="stop")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs: true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", param="top_logprobs")

    @property
    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def items(self) -> list[dict[str, Any]]:
        return [item for message in self.messages for item in message.items()]

    def _tools(self) -> list[dict[str, Any]] | None:
        """Chat's ``{"type": "function", "function": {...}}`` as a Responses function tool;
        Chat tools are not strict unless they say so."""
        if self.tools is None:
            return None
        out: list[dict[str, Any]] = []
        for i, tool in enumerate(self.tools):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) or set(tool) - {"type", "function"}:
                raise InvalidRequestError("a tool is {'type': 'function', 'function': {...}}", param=f"tools[{i}]")
            out.append({"type": "function", "strict": False, **function})
        return out

    def _tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, dict):
            function = choice.get("function")
            if choice.get("type") != "function" or not isinstance(function, dict) or "name" not in function:
                raise InvalidRequestError(
                    "tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                    param="tool_choice",
                )
            return {"type": "function", "name": function["name"]}
        return choice

    def _text(self) -> dict[str, Any] | None:
        """``response_format`` as Responses' ``text.format`` (Chat nests the json_schema)."""
        fmt = self.response_format
        if fmt is None:
            return None
        text = {"format": fmt}
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or set(fmt) - {"type", "json_schema"}:
                raise InvalidRequestError(
                    "response_format json_schema needs a json_schema object", param="response_format.json_schema"
                )
            text = {"format": {"type": "json_schema", **spec}}
        try:
            text_param(text)
        except InvalidRequestError as exc:
            if exc.param == "text.format.name":  # a field of the json_schema object Chat nests
                where = "response_format.json_schema.name"
                raise InvalidRequestError(exc.message.replace(exc.param, where), param=where) from exc
            raise InvalidRequestError(
                exc.message.replace("text.format", "response_format"), param="response_format"
            ) from exc
        return text

    def to_response_request(self) -> tuple[Accepted[ResponseRequest], ChatExtras]:
        """Validate, then translate, and the translation accepted as the Responses request it
        runs as. System and developer messages stay messages, in place, rather than becoming
        ``instructions``: their order is the client's."""
        self.validate()
        request = ResponseRequest(
            model=self.model,
            input=self.items(),
            max_output_tokens=self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            metadata=self.metadata,
            store=False,
            stream=self.stream,
            parallel_tool_calls=self.parallel_tool_calls,
            tools=self._tools(),
            tool_choice=self._tool_choice(),
            text=self._text(),
            safety_identifier=self.safety_identifier,
            prompt_cache_key=self.prompt_cache_key,
        )
        accepted = accept(request)
        extras = ChatExtras(
            stop=self.stop_sequences,
            seed=self.seed,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )
        return accepted, extras
