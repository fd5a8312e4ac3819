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
    # How a custom tool's raw input is carried; None: the family has no way to (docs/responses.md,
    # "Custom tools").
    custom: CustomSyntax | None = None


@dataclass(frozen=True)
class CustomSyntax:
    """A custom tool's call: ``head`` (lark) before the input; ``close``, the text that ends the
    input (its family's end marker when empty); ``stop``, where the parser ends it, which the
    input therefore never holds; ``after`` (lark), what follows ``close`` before the end marker."""

    head: Callable[[CustomTool], str]
    close: str = ""
    stop: str = ""
    after: str = ""


def _params(tool: FunctionTool) -> dict[str, Any]:
    # A function declared without parameters takes none.
    return dict(tool.parameters) if tool.parameters is not None else {"type": "object", "additionalProperties": False}


def _json_call(key: str) -> Callable[[FunctionTool, Mapping[str, int]], str]:
    def body(tool: FunctionTool, special: Mapping[str, int]) -> str:
        head = json.dumps({"name": tool.name})[:-1] + f', "{key}": '
        return f"{json.dumps(head)} %json {json.dumps(with_layout(_params(tool)))} " + '"}"'

    return body


def _xml_value(schema: Mapping[str, Any]) -> str:
    """A Qwen3-Coder parameter value as text, then the newline and ``</parameter>`` that close it.
    Numbers, booleans, objects and arrays are written as JSON, so JSON's grammar enforces their
    bounds; strings are bare text, in one lexeme with what closes them: llguidance's lexer is
    greedy, and a text lexeme followed by its own closing newline would swallow that newline
    (then ``<`` could never follow, and the value ran to its maxLength)."""
    enum = schema.get("enum")
    close = '"\\n</parameter>"'
    if enum is not None and all(isinstance(v, str) for v in enum):
        return f"({' | '.join(json.dumps(v) for v in enum)}) {close}"
    if schema.get("type") == "string":
        return f"/[^<]{{{schema.get('minLength', 0)},{schema.get('maxLength', 256)}}}\\n<\\/parameter>/"
    return f"%json {json.dumps(with_layout(schema))} {close}"


def _xml_call(tool: FunctionTool, special: Mapping[str, int]) -> str:
    # Qwen3-Coder writes each parameter as an XML element holding its value as text.
    params = _params(tool)
    required = set(params.get("required", []))
    parts = []
    for name, schema in params.get("properties", {}).items():
        element = f'"<parameter={name}>\\n" {_xml_value(schema)} "\\n"'
        parts.append(f"({element})" if name in required else f"({element})?")
    return f'"\\n<function={tool.name}>\\n" {" ".join(parts)} "</function>\\n"'


def _mistral_call(tool: FunctionTool, special: Mapping[str, int]) -> str:
    return f'"{tool.name}" {_marker("[ARGS]", special)} %json {json.dumps(with_layout(_params(tool)))}'


# Hermes: the name alone on the block's first line, then the input up to the end marker.
HERMES_CUSTOM = CustomSyntax(lambda t: json.dumps(f"\n{t.name}\n"), stop="</tool_call>")
# Qwen3-Coder: one parameter, "input", its value the raw text as XML parameter text is (the
# newlines around it are the markup's, as for every parameter).
QWEN3_CODER_CUSTOM = CustomSyntax(
    lambda t: json.dumps(f"\n<function={t.name}>\n<parameter=input>\n"),
    close="\n</parameter>",
    stop="</parameter>",
    after='"\\n</function>\\n"',
)

SYNTAXES: dict[str, CallSyntax] = {
    "json_tools": CallSyntax(
        "<tool_call>",
        "</tool_call>",
        lambda t, special: f'"\\n" {_json_call("arguments")(t, special)} "\\n"',
        custom=HERMES_CUSTOM,
    ),
    "qwen3_coder": CallSyntax("<tool_call>", "</tool_call>", _xml_call, custom=QWEN3_CODER_CUSTOM),
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


def custom_input(tool: CustomTool, syntax: CallSyntax, special: Mapping[str, int], rule: str) -> str:
    """Rule ``rule``: a custom tool's input and what follows it up to the end marker (with the
    rules it needs).

    The parser ends the input at the first ``stop`` text, so the input never holds one: a
    regular expression (free text is ``(?s:.*)``) is intersected with "holds no ``stop``", in
    one lexeme with the ``close`` text after it. One lexeme, because llguidance's lexer is
    greedy: a lexeme that may run on would swallow the text after it. A special token ends
    any text lexeme by itself. A Lark grammar is nested (its rule names are its own) and
    followed by ``close``."""
    custom = syntax.custom
    assert custom is not None, "custom tools are refused for this family (prompt.build_prompt)"
    fmt, close = tool.format, custom.close or syntax.end
    after = f"{custom.after} {_marker(syntax.end, special)}" if custom.close else ""
    closing = _marker(close, special)
    if isinstance(fmt, CustomGrammar) and fmt.syntax == "lark":
        return f"{rule}: {rule}_grammar {closing} {after}\n{rule}_grammar: %lark {{\n{fmt.definition}\n}}\n"
    pattern = regex_lexeme(fmt.definition) if isinstance(fmt, CustomGrammar) else "/(?s:.*)/"
    lexeme = f"({pattern} & ~/(?s:.*{regex_lexeme(re.escape(custom.stop))[1:-1]}.*)/)"
    name = rule.upper()
    if close in special:
        return f"{rule}: {name} {closing} {after}\n{name}: {lexeme}\n"
    return f"{rule}: {name} {after}\n{name}: {lexeme} {closing}\n"


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
        if isinstance(tool, CustomTool) and syntax.custom is not None:
            heads.append(f"{syntax.custom.head(tool)} input_{i}")  # the input rule ends with the end marker
            inputs += custom_input(tool, syntax, special, f"input_{i}")
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
        # A text lexeme ends at a special token by itself, and llguidance refuses one inside a
        # lazy lexeme: only a textual marker needs the lazy rule.
        lazy = "" if think_end in special else "[lazy]"
        rules += f"think{lazy}: THOUGHT {_marker(think_end, special)}\nTHOUGHT: /(.|\\n)*/\n"
        top = f"think /[ \\n]*/ ({top})"
    return f"%llguidance {{}}\nstart: {top}\n{rules}"


def grammar_param(text_format: TextFormatParam | None, tools: ToolOptions) -> str:
    """The request field a grammar error is reported against."""
    if isinstance(text_format, JsonSchemaFormat | JsonObjectFormat):
        return "text.format.schema"
    return "tools"
