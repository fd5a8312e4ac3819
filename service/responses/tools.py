"""Function tools, tool_choice, text.format and reasoning of a Responses request.

Decoding validates the shapes; :func:`directives` checks how they fit together and returns
them in their typed form (:class:`Directives`), each wrong value a 400 naming its field. A
request is parsed into its directives once, at intake; every later stage reads them. Parsing
is cheap and takes no schema apart: whether decoding can enforce the schemas, and within what
budget, is :func:`lmspd.responses.enforce.check_directives`, run in a worker thread.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from lmspd.errors import InvalidRequestError

BUILTIN_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "computer_use_preview",
        "computer_use",
        "code_interpreter",
        "image_generation",
        "mcp",
        "custom",
        "apply_patch",
        "function_shell",
        "local_shell",
    }
)
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class FunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=False):
    """Open Responses ``FunctionTool``; echoed on the response with every field present."""

    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # OpenAI's Responses API makes function tools strict unless told otherwise.
    strict: bool | None = True


class NamedFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True, forbid_unknown_fields=True):
    name: str  # required, as OpenAI requires it (text.format.name; Chat: response_format.json_schema.name)
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True):
    pass


class TextFormatPlain(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


TextFormatParam = TextFormatPlain | JsonSchemaFormat | JsonObjectFormat


class TextParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormatParam | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Echoed only: the seed says effort is not mapped onto a template kwarg
    # (chat_template_kwargs does that explicitly).
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


Choice = Literal["none", "auto", "required"] | NamedFunction


class ToolOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What generation needs to know about tools: those rendered into the prompt, the
    calls it may make, and whether decoding is constrained to a valid call."""

    tools: list[FunctionTool]
    choice: Literal["none", "auto", "required"] | str  # str: the one function it must call
    parallel: bool
    max_calls: int | None

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def callable(self) -> list[FunctionTool]:
        if self.choice in ("none", "auto", "required"):
            return self.tools
        return [t for t in self.tools if t.name == self.choice]

    @property
    def constrained(self) -> bool:
        """A call must come out valid: it is required, named, or a strict tool may be called."""
        if not self.active:
            return False
        return self.choice != "auto" or any(t.strict for t in self.tools)

    @property
    def call_limit(self) -> int | None:
        # A named function is called once: a forced call that may repeat, repeats (small
        # models call it again and again until the token budget runs out).
        once = not self.parallel or self.choice not in ("none", "auto", "required")
        limits = [n for n in (self.max_calls, 1 if once else None) if n is not None]
        return min(limits) if limits else None


def _convert(obj: Any, kind: Any, param: str) -> Any:
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from exc


def parse_tools(raw: list[dict[str, Any]] | None) -> list[FunctionTool]:
    tools: list[FunctionTool] = []
    names: set[str] = set()
    for i, obj in enumerate(raw or []):
        kind = obj.get("type")
        if kind in BUILTIN_TOOLS:
            raise InvalidRequestError(
                f"built-in tool type '{kind}' is not supported: lmspd runs no hosted tools", param=f"tools[{i}].type"
            )
        if kind != "function":
            raise InvalidRequestError(f"unknown tool type {kind!r}; only 'function' tools", param=f"tools[{i}].type")
        tool: FunctionTool = _convert(obj, FunctionTool, f"tools[{i}]")
        if not _NAME.match(tool.name):
            raise InvalidRequestError(
                "a function name is 1-64 characters of a-z, A-Z, 0-9, '_' and '-'", param=f"tools[{i}].name"
            )
        if tool.name in names:
            raise InvalidRequestError(f"two tools are named {tool.name!r}", param=f"tools[{i}].name")
        names.add(tool.name)
        if tool.parameters is not None and tool.parameters.get("type", "object") != "object":
            raise InvalidRequestError("function parameters must be an object schema", param=f"tools[{i}].parameters")
        tools.append(tool)
    return tools


def tool_options(
    raw_tools: list[dict[str, Any]] | None,
    raw_choice: str | dict[str, Any] | None,
    parallel: bool | None,
    max_calls: int | None,
) -> ToolOptions:
    tools = parse_tools(raw_tools)
    choice: Choice = _convert("auto" if raw_choice is None else raw_choice, Choice, "tool_choice")
    if isinstance(choice, NamedFunction):
        if not any(t.name == choice.name for t in tools):
            raise InvalidRequestError(f"tool_choice names {choice.name!r}, which is not in tools", param="tool_choice")
        name: str = choice.name
    else:
        name = choice
        if choice == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs at least one tool", param="tool_choice")
    return ToolOptions(tools=tools, choice=name, parallel=parallel is not False, max_calls=max_calls)


def text_param(raw: dict[str, Any] | None) -> TextParam:
    sent = (raw or {}).get("format")
    if isinstance(sent, dict) and sent.get("type") == "json_schema" and "name" not in sent:
        raise InvalidRequestError("Missing required parameter: 'text.format.name'", param="text.format.name")
    param: TextParam = _convert(raw or {}, TextParam, "text")
    fmt = param.format
    if isinstance(fmt, JsonSchemaFormat) and not _NAME.match(fmt.name):
        raise InvalidRequestError(
            "text.format.name is 1-64 characters of a-z, A-Z, 0-9, '_' and '-'", param="text.format.name"
        )
    return param


def reasoning_param(raw: dict[str, Any] | None) -> ReasoningParam | None:
    return None if raw is None else _convert(raw, ReasoningParam, "reasoning")


class Directives(msgspec.Struct, frozen=True, kw_only=True):
    """A request's tools, tool_choice, text and reasoning, typed and checked together: what the
    response echoes, the prompt renders and the grammar enforces."""

    tools: ToolOptions
    text: TextParam
    reasoning: ReasoningParam | None

    @property
    def text_format(self) -> TextFormatParam | None:
        return self.text.format


def directives(
    *,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    max_tool_calls: int | None,
    text: dict[str, Any] | None,
    reasoning: dict[str, Any] | None,
) -> Directives:
    """The raw fields parsed (their schemas are checked by ``enforce.check_directives``)."""
    return Directives(
        tools=tool_options(tools, tool_choice, parallel_tool_calls, max_tool_calls),
        text=text_param(text),
        reasoning=reasoning_param(reasoning),
    )
