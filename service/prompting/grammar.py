"""Grammars (llguidance) that keep structured output and tool calls valid.

The server builds the grammar text at intake, so a schema the grammar cannot
enforce answers 400 before anything is stored; the engine compiles it (once per
distinct grammar) and masks the logits of that request with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmspd.responses.enforce import with_layout
from lmspd.responses.tools import (
    CustomGrammar,
    CustomTool,
    FunctionTool,
    JsonObjectFormat,
    JsonSchemaFormat,
    OfferedTool,
    TextFormatParam,
    ToolOptions,
)


@dataclass(frozen=True)
class CallSyntax:
    """How one model family spells a tool call, as grammar pieces."""

    start: str  # marker that opens a call ("" when a call is bare JSON)
    end: str
    body: Callable[[FunctionTool, Mapping[str, int]], str]  # one call of this tool, between the markers
    separator: str = "\n"
    # The head of a custom tool's call, before its raw input, which runs to the end marker;
    # None: the family has no way to carry raw text (docs/responses.md, "Custom tools").
    custom_head: Callable[[CustomTool], str] | None = None


def _params(tool: FunctionTool) -> dict[str, Any]:
    # A function declared without parameters takes none.
    return dict(tool.parameters) if tool.parameters is not None else {"type": "object", "additionalProperties": False}


def _json_call(key: str) -> Callable[[FunctionTool, Mapping[str, int]], str]:
    def body(tool: FunctionTool, special: Mapping[str, int]) -> str:
        head = json.dumps({"name": tool.name})[:-1] + f', "{key}": '
        return f"{json.dumps(head)} %json {json.dumps(with_layout(_params(tool)))} " + '"}"'

    return body


def _xml_value(schema: Mapping[str, Any]) -> str:
    """A Qwen3-Coder parameter value as text. Numbers, booleans, objects and arrays are
    written as JSON, so JSON's grammar enforces their bounds; strings are bare text."""
    enum = schema.get("enum")
    if enum is not None and all(isinstance(v, str) for v in enum):
        return " | ".join(json.dumps(v) for v in enum)
    if schema.get("type") == "string":
        return f"/[^<]{{{schema.get('minLength', 0)},{schema.get('maxLength', 256)}}}/"
    return f"%json {json.dumps(with_layout(schema))}"


def _xml_call(tool: FunctionTool, special: Mapping[str, int]) -> str:
    # Qwen3-Coder writes each parameter as an XML element holding its value as text.
    params = _params(tool)
    required = set(params.get("required", []))
    parts = []
    for name, schema in params.get("properties", {}).items():
        element = f'"<parameter={name}>\\n" ({_xml_value(schema)}) "\\n</parameter>\\n"'
        parts.append(f"({element})" if name in required else f"({element})?")
    return f'"\\n<function={tool.name}>\\n" {" ".join(parts)} "</function>\\n"'


def _mistral_call(tool: FunctionTool, special: Mapping[str, int]) -> str:
    return f'"{tool.name}" {_marker("[ARGS]", special)} %json {json.dumps(with_layout(_params(tool)))}'


def _hermes_custom(tool: CustomTool) -> str:
    return json.dumps(f"\n{tool.name}\n")  # the name alone on the first line


SYNTAXES: dict[str, CallSyntax] = {
    "json_tools": CallSyntax(
        "<tool_call>",
        "</tool_call>",
        lambda t, special: f'"\\n" {_json_call("arguments")(t, special)} "\\n"',
        custom_head=_hermes_custom,
    ),
    "qwen3_coder": CallSyntax("<tool_call>", "</tool_call>", _xml_call),
    "llama3_json": CallSyntax("", "", _json_call("parameters"), separator="; "),
    "mistral": CallSyntax("[TOOL_CALLS]", "", _mistral_call, separator=""),
}


def _marker(text: str, special: Mapping[str, int]) -> str:
    """A marker as lark: the special token when the vocabulary has one, else the text."""
    if not text:
        return ""
    return f"<[{special[text]}]>" if text in special else json.dumps(text)


def regex_lexeme(pattern: str) -> str:
    """A regular expression as a lark lexeme, escaped as llguidance escapes its own."""
    from llguidance import LLMatcher

    lark = json.loads(LLMatcher.grammar_from_regex(pattern))["grammars"][0]["lark_grammar"]
    return str(lark).removeprefix("start: ")


def custom_input(tool: CustomTool, end: str, special: Mapping[str, int], rule: str) -> str:
    """Rule ``rule``: a custom tool's input, then the end marker ``end`` (and the rules it needs).

    The parser ends the input at the first end marker, so the input cannot hold one: a
    regular expression is intersected with "holds no end marker", in one lexeme with the
    marker; free text is a lazy lexeme that ends at it. One lexeme, because llguidance's lexer
    is greedy: a lexeme that may run on would swallow a marker after it. Where the marker is
    a special token no text lexeme holds it, and the input ends there. A Lark grammar is
    nested (its rule names are its own) and followed by the marker."""
    fmt, marker = tool.format, _marker(end, special)
    name = rule.upper()
    if isinstance(fmt, CustomGrammar) and fmt.syntax == "lark":
        return f"{rule}: {rule}_grammar {marker}\n{rule}_grammar: %lark {{\n{fmt.definition}\n}}\n"
    pattern = regex_lexeme(fmt.definition) if isinstance(fmt, CustomGrammar) else "/(?s:.*)/"
    if end in special:
        return f"{rule}: {name} {marker}\n{name}: {pattern}\n"
    if isinstance(fmt, CustomGrammar):
        holds = f"~/(?s:.*{regex_lexeme(re.escape(end))[1:-1]}.*)/"
        return f"{rule}: {name}\n{name}: ({pattern} & {holds}) {marker}\n"
    return f"{rule}[lazy]: {pattern} {marker}\n"


def _calls(
    syntax: CallSyntax, tools: list[OfferedTool], special: Mapping[str, int], limit: int | None, lazy: bool
) -> str:
    """Rules ``calls`` (one or more calls, at most ``limit``) and ``call``.

    ``lazy``: free text comes first, and the first call's marker ends it (a lazy
    lexeme), so only what follows the marker is constrained. Every tool's body is written
    once, in rule ``body``, however many rules use it: a grammar is compiled (and its
    JSON schemas with it) once per occurrence, so a copy would double the work."""
    bodies = [f"({syntax.body(t, special)})" for t in tools if isinstance(t, FunctionTool)]
    heads, inputs = [], ""
    for i, tool in enumerate(tools):
        if isinstance(tool, CustomTool):
            assert syntax.custom_head is not None, "custom tools are refused for this family (prompt.build_prompt)"
            heads.append(f"{syntax.custom_head(tool)} input_{i}")  # the input ends with the end marker
            inputs += custom_input(tool, syntax.end, special, f"input_{i}")
    rules = f"body: {' | '.join(bodies)}\n" if bodies else ""
    rest = f"body {_marker(syntax.end, special)}" if bodies else ""
    if heads:
        rules += f"custom: {' | '.join(heads)}\n{inputs}"
        rest = f"({rest} | custom)" if bodies else "custom"
    opener = _marker(syntax.start, special)
    rules += f"call: {opener} {rest}\n"
    first = "call"
    if lazy:
        rules += "TEXT: /(.|\\n)*/\n"
        if syntax.start in special:  # text cannot contain a special token: it ends there
            rules += f"first: TEXT {opener} {rest}\n"
        else:  # a lazy lexeme ends the text at the marker's first appearance
            rules += f"first: lead {rest}\nlead[lazy]: TEXT {opener}\n"
        first = "first"
    sep = json.dumps(syntax.separator) if syntax.separator else ""
    more = "" if limit == 1 else f" ({sep} call)" + ("*" if limit is None else f"{{0,{limit - 1}}}")
    return rules + f"calls: {first}{more}\n"


def build(
    *,
    text_format: TextFormatParam | None,
    tools: ToolOptions,
    tool_format: str | None,
    special: Mapping[str, int],
    think_end: str | None = None,
) -> str | None:
    """The grammar (lark) for one request, or None when its output is free text.

    ``think_end``: the prompt opened a reasoning block; the grammar lets it run until
    this marker and constrains what follows."""
    answer: str | None = None
    if isinstance(text_format, JsonSchemaFormat):
        answer = f"%json {json.dumps(with_layout(text_format.schema))}"
    elif isinstance(text_format, JsonObjectFormat):
        answer = f"%json {json.dumps(with_layout({'type': 'object'}))}"
    syntax = SYNTAXES.get(tool_format or "")
    rules = ""
    if tools.constrained and syntax is not None:
        free_text = tools.choice == "auto" and answer is None
        if free_text and not syntax.start:
            return None  # a bare-JSON call has no marker to wait for: it stays free text
        rules = _calls(syntax, tools.callable, special, tools.call_limit, lazy=free_text)
        if tools.choice != "auto":
            top = "calls"
        elif answer is not None:
            top = "answer | calls"  # a JSON answer starts with "{", a call with its marker
        else:
            top = "TEXT | calls"
    elif answer is not None:
        top = "answer"
    else:
        return None
    if answer is not None:
        rules += f"answer: {answer}\n"
    if think_end:
        rules += f"think[lazy]: THOUGHT {_marker(think_end, special)}\nTHOUGHT: /(.|\\n)*/\n"
        top = f"think /[ \\n]*/ ({top})"
    return f"%llguidance {{}}\nstart: {top}\n{rules}"


def grammar_param(text_format: TextFormatParam | None, tools: ToolOptions) -> str:
    """The request field a grammar error is reported against."""
    if isinstance(text_format, JsonSchemaFormat | JsonObjectFormat):
        return "text.format.schema"
    return "tools"
