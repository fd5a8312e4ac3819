"""Function tools, tool_choice, text.format and reasoning of a Responses request.

Decoding validates the shapes; :func:`directives` checks how they fit together and returns
them in their typed form (:class:`Directives`), each wrong value a 400 naming its field. A
request is parsed into its directives once, at intake; every later stage reads them. Parsing
is cheap and takes no schema apart: whether decoding can enforce the schemas, and within what
budget, is :func:`lmspd.responses.enforce.check_directives`, run in a worker thread.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from lmspd.errors import InvalidRequestError

# OpenAI's hosted tools: they run on OpenAI's servers, and nothing here runs them (docs/responses.md
# "Coding agents"). Refused by default, as the seed says; ``[responses] hosted_tools = "omit"``
# leaves them out instead (:func:`omit_hosted`).
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "computer_use_preview",
        "computer_use",
        "code_interpreter",
        "image_generation",
        "mcp",
        "apply_patch",
        "function_shell",
        "shell",
        "local_shell",
        "tool_search",
    }
)
# How to turn a hosted tool off on the client, where a known client sends it by default.
_TURN_OFF = {"web_search": 'Codex: web_search = "disabled" in config.toml'}
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# A namespaced function is offered to the model as "<namespace>.<name>" (docs/responses.md).
NAMESPACE_SEPARATOR = "."


class FunctionTool(
    msgspec.Struct, tag="function", tag_field="type", kw_only=True, forbid_unknown_fields=True, omit_defaults=False
):
    """Open Responses ``FunctionTool``; echoed on the response with every field present."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # OpenAI's Responses API makes function tools strict unless told otherwise.
    strict: bool | None = True


class CustomText(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    """A custom tool's input is free text."""


class CustomGrammar(msgspec.Struct, tag="grammar", tag_field="type", kw_only=True, forbid_unknown_fields=True):
    """A custom tool's input matches a grammar: Lark or a regular expression (llguidance reads both)."""

    syntax: Literal["lark", "regex"]
    definition: str


class CustomTool(
    msgspec.Struct, tag="custom", tag_field="type", kw_only=True, forbid_unknown_fields=True, omit_defaults=False
):
    """OpenAI's ``custom`` (freeform) tool: called with raw text, not JSON (``custom_tool_call``)."""

    name: str
    description: str | None = None
    format: CustomText | CustomGrammar = msgspec.field(default_factory=CustomText)


class NamespaceTool(
    msgspec.Struct, tag="namespace", tag_field="type", kw_only=True, forbid_unknown_fields=True, omit_defaults=False
):
    """OpenAI's ``namespace``: a group of function and custom tools (Codex sends its sub-agent
    tools as one). Its tools are offered to the model under qualified names."""

    name: str
    description: str = ""
    tools: list[FunctionTool | CustomTool]


Tool = FunctionTool | CustomTool | NamespaceTool
OfferedTool = FunctionTool | CustomTool


class NamedFunction(msgspec.Struct, tag="function", tag_field="type", kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedCustom(msgspec.Struct, tag="custom", tag_field="type", kw_only=True, forbid_unknown_fields=True):
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
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    # Which reasoning items of the input are rendered: "current_turn" only those after the
    # last user message; "auto" and "all_turns" every one (what templates then keep is theirs).
    context: Literal["auto", "all_turns", "current_turn"] | None = None


Choice = Literal["none", "auto", "required"] | NamedFunction | NamedCustom


def is_strict(tool: OfferedTool) -> bool:
    """A call of it must come out valid: a strict function, or a custom tool with a grammar."""
    return bool(tool.strict) if isinstance(tool, FunctionTool) else isinstance(tool.format, CustomGrammar)


class ToolOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What generation needs to know about tools: those rendered into the prompt, the
    calls it may make, and whether decoding is constrained to a valid call.

    ``tools`` are the tools offered to the model, namespaces flattened (a namespaced tool
    under its qualified name, ``namespaces`` maps it back); ``params`` the request field of
    each; ``declared`` the tools as sent, echoed on the response."""

    tools: list[OfferedTool]
    choice: Literal["none", "auto", "required"] | str  # str: the one tool it must call (qualified)
    parallel: bool
    max_calls: int | None
    declared: list[Tool] = []
    params: list[str] = []
    namespaces: dict[str, str] = {}

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def callable(self) -> list[OfferedTool]:
        if self.choice in ("none", "auto", "required"):
            return self.tools
        return [t for t in self.tools if t.name == self.choice]

    @property
    def constrained(self) -> bool:
        """A call must come out valid: it is required, named, or a strict tool may be called."""
        if not self.active:
            return False
        return self.choice != "auto" or any(is_strict(t) for t in self.tools)

    @property
    def call_limit(self) -> int | None:
        # A named function is called once: a forced call that may repeat, repeats (small
        # models call it again and again until the token budget runs out).
        once = not self.parallel or self.choice not in ("none", "auto", "required")
        limits = [n for n in (self.max_calls, 1 if once else None) if n is not None]
        return min(limits) if limits else None

    def param(self, tool: OfferedTool) -> str:
        """The request field that declared ``tool`` (``tools[3]``, ``tools[4].tools[0]``)."""
        return self.params[self.tools.index(tool)] if self.params else f"tools[{self.tools.index(tool)}]"

    def origin(self, offered: str) -> tuple[str, str | None]:
        """A called tool's name as the client declared it, and its namespace (None: top level)."""
        return origin(offered, self.namespaces)


def qualified(name: str, namespace: str | None) -> str:
    """How the model knows a tool: a namespaced one as ``<namespace>.<name>``."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def origin(offered: str, namespaces: Mapping[str, str]) -> tuple[str, str | None]:
    """The inverse of :func:`qualified`, by the namespace map of the request's tools."""
    namespace = namespaces.get(offered)
    return (offered[len(namespace) + len(NAMESPACE_SEPARATOR) :], namespace) if namespace else (offered, None)


def functions(tools: list[OfferedTool]) -> list[FunctionTool]:
    """The function tools among ``tools``."""
    return [t for t in tools if isinstance(t, FunctionTool)]


def customs(tools: list[OfferedTool]) -> list[CustomTool]:
    """The custom (freeform) tools among ``tools``."""
    return [t for t in tools if isinstance(t, CustomTool)]


def _convert(obj: Any, kind: Any, param: str) -> Any:
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from exc


def hosted_refusal(kind: str, param: str) -> InvalidRequestError:
    how = _TURN_OFF.get(kind, "leave it out of tools")
    return InvalidRequestError(
        f"hosted tool type '{kind}' is not supported: lmspd runs no hosted tools. Turn it off on the client "
        f'({how}), or start lmspd with [responses] hosted_tools = "omit" to leave such tools out',
        param=f"{param}.type",
    )


def hosted_type(tool: Any) -> str | None:
    """The hosted tool type ``tool`` declares, or None. A ``type`` that is no string (a list, an
    object: unhashable) declares none; parsing the tools then refuses it by name."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    return kind if isinstance(kind, str) and kind in HOSTED_TOOLS else None


def omit_hosted(raw: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """``raw`` tools without the hosted ones, and the types left out (``hosted_tools = "omit"``)."""
    if not raw:
        return raw, []
    kept = [t for t in raw if hosted_type(t) is None]
    omitted = [kind for t in raw if (kind := hosted_type(t)) is not None]
    return kept, omitted


def _check_name(name: str, param: str) -> None:
    if not _NAME.match(name):
        raise InvalidRequestError("a tool name is 1-64 characters of a-z, A-Z, 0-9, '_' and '-'", param=f"{param}.name")


def _offered(tool: OfferedTool, param: str) -> None:
    _check_name(tool.name, param)
    if isinstance(tool, FunctionTool):
        if tool.parameters is not None and tool.parameters.get("type", "object") != "object":
            raise InvalidRequestError("function parameters must be an object schema", param=f"{param}.parameters")
    elif isinstance(tool.format, CustomGrammar) and not tool.format.definition.strip():
        raise InvalidRequestError("a grammar's definition must not be empty", param=f"{param}.format.definition")


class ParsedTools(msgspec.Struct, frozen=True, kw_only=True):
    declared: list[Tool]
    offered: list[OfferedTool]
    params: list[str]
    namespaces: dict[str, str]


def parse_tools(raw: list[dict[str, Any]] | None) -> ParsedTools:
    declared: list[Tool] = []
    offered: list[OfferedTool] = []
    params: list[str] = []
    namespaces: dict[str, str] = {}
    for i, obj in enumerate(raw or []):
        where = f"tools[{i}]"
        if (hosted := hosted_type(obj)) is not None:
            raise hosted_refusal(hosted, where)
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind not in ("function", "custom", "namespace"):
            raise InvalidRequestError(
                f"unknown tool type {kind!r}; tools here are 'function', 'custom' and 'namespace'",
                param=f"{where}.type",
            )
        tool: Tool = _convert(obj, Tool, where)
        declared.append(tool)
        if isinstance(tool, NamespaceTool):
            _check_name(tool.name, where)
            if not tool.tools:
                raise InvalidRequestError("a namespace needs at least one tool", param=f"{where}.tools")
            for j, inner in enumerate(tool.tools):
                _offered(inner, f"{where}.tools[{j}]")
                offered_as = qualified(inner.name, tool.name)
                offered.append(msgspec.structs.replace(inner, name=offered_as))
                params.append(f"{where}.tools[{j}]")
                namespaces[offered_as] = tool.name
        else:
            _offered(tool, where)
            offered.append(tool)
            params.append(where)
    seen: set[str] = set()
    for tool, param in zip(offered, params, strict=True):
        if tool.name in seen:
            raise InvalidRequestError(f"two tools are named {tool.name!r}", param=f"{param}.name")
        seen.add(tool.name)
    return ParsedTools(declared=declared, offered=offered, params=params, namespaces=namespaces)


def tool_options(
    raw_tools: list[dict[str, Any]] | None,
    raw_choice: str | dict[str, Any] | None,
    parallel: bool | None,
    max_calls: int | None,
) -> ToolOptions:
    parsed = parse_tools(raw_tools)
    tools = parsed.offered
    choice: Choice = _convert("auto" if raw_choice is None else raw_choice, Choice, "tool_choice")
    if isinstance(choice, NamedFunction | NamedCustom):
        kind = FunctionTool if isinstance(choice, NamedFunction) else CustomTool
        # A namespaced tool may be named by its qualified name or, when that is unambiguous, its own.
        matches = [
            t for t in tools if isinstance(t, kind) and choice.name in (t.name, origin(t.name, parsed.namespaces)[0])
        ]
        if len(matches) != 1:
            what = "is not in tools" if not matches else "names more than one tool: use '<namespace>.<name>'"
            raise InvalidRequestError(f"tool_choice names {choice.name!r}, which {what}", param="tool_choice")
        name: str = matches[0].name
    else:
        name = choice
        if choice == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs at least one tool", param="tool_choice")
    return ToolOptions(
        tools=tools,
        choice=name,
        parallel=parallel is not False,
        max_calls=max_calls,
        declared=parsed.declared,
        params=parsed.params,
        namespaces=parsed.namespaces,
    )


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
