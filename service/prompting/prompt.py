"""A request's prompt for one model: the rendered text, and how to read and constrain the output.

Tools go through the model's own chat template when it renders them; a template that
ignores tools (the bundled SmolLM2's) gets a Hermes-style tool block in the system
prompt, and the output is parsed in that format. The same inputs always give the
same ``Prompt``, so a resumed task rebuilds exactly what its first attempt used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec

from lmspd.errors import InvalidRequestError
from lmspd.models.tokenizer import Tokenizer
from lmspd.prompting import grammar
from lmspd.responses.compaction import expand, fold_summary
from lmspd.responses.inputs import (
    Item,
    MessageItem,
    ReasoningItem,
    hermes_custom_call,
    qwen3_coder_custom_call,
    to_messages,
)
from lmspd.responses.parsing.output_parser import OutputParser, infer_tool_format, think_markers
from lmspd.responses.schema import ResponseRequest, directives_of
from lmspd.responses.tools import CustomTool, Directives, FunctionTool, ToolOptions, customs, functions

HERMES_FORMAT = "json_tools"
# How a custom (freeform) tool is called, per family (docs/responses.md, "Custom tools"): in
# the Hermes family its name alone on the block's first line, then its input as it is, up to
# the end marker; in Qwen3-Coder's XML, its one parameter "input" holds the raw text.
CUSTOM_SYNTAX = {
    "json_tools": (
        'For a custom tool ("type": "custom"), write its name alone on the first line and then its input as '
        "raw text, not JSON, following its format, with </tool_call> right after the input:\n"
        "<tool_call>\n<tool-name>\n<raw input></tool_call>"
    ),
    "qwen3_coder": (
        'For a custom tool ("type": "custom"), pass its input as raw text, not JSON, following its format, in '
        "one parameter named input:\n<tool_call>\n<function=tool-name>\n<parameter=input>\n<raw input>\n"
        "</parameter>\n</function>\n</tool_call>"
    ),
}
CUSTOM_CALLS = {"json_tools": hermes_custom_call, "qwen3_coder": qwen3_coder_custom_call}


def _hermes_block(tools: list[FunctionTool], custom: list[CustomTool]) -> str:
    # The wording of Qwen2.5 / Hermes templates, which small instruct models have seen.
    entries = [_chat_tool(t) for t in tools] + [_custom_entry(t) for t in custom]
    lines = "\n".join(json.dumps(e, ensure_ascii=False) for e in entries)
    block = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    return f"{block}\n\n{CUSTOM_SYNTAX[HERMES_FORMAT]}" if custom else block


def _custom_block(custom: list[CustomTool], tool_format: str) -> str:
    """Custom tools for a template that renders only function tools itself."""
    lines = "\n".join(json.dumps(_custom_entry(t), ensure_ascii=False) for t in custom)
    syntax = CUSTOM_SYNTAX[tool_format]
    return f"# Custom tools\n\nYou may also call these custom tools:\n<tools>\n{lines}\n</tools>\n\n{syntax}"


def _custom_entry(tool: CustomTool) -> dict[str, Any]:
    """A custom tool as the model is shown it: its format (grammar included) says what input it takes."""
    fmt = msgspec.to_builtins(tool.format)
    return {"type": "custom", "name": tool.name, "description": tool.description or "", "format": fmt}


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    """A tool as chat templates (and mlx-lm's parsers) expect it."""
    function: dict[str, Any] = {"name": tool.name, "description": tool.description or ""}
    function["parameters"] = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


@dataclass(frozen=True)
class Prompt:
    text: str
    tool_format: str | None  # how calls in the output are read; None: they are not
    tools: ToolOptions
    think: tuple[str, str] | None
    reasoning_open: bool  # the prompt ends inside a reasoning block
    grammar: str | None
    grammar_param: str  # the request field a grammar error is reported against

    def parser(self) -> OutputParser:
        return OutputParser(
            tool_format=self.tool_format,
            tools=[_chat_tool(t) for t in functions(self.tools.tools)],
            custom=[t.name for t in customs(self.tools.tools)],
            reasoning=self.reasoning_open,
            think=self.think,
            max_calls=self.tools.call_limit,
            bound=self.grammar is not None and self.tools.constrained,
        )


@dataclass(frozen=True)
class Traits:
    think: tuple[str, str] | None
    native_tools: bool  # the template renders tools itself
    tool_format: str
    places_reasoning: bool = False  # the template renders a message's ``reasoning_content`` itself


@lru_cache(maxsize=16)
def traits(tok: Tokenizer) -> Traits:
    """What a model's template and vocabulary say about reasoning and tool calls."""
    native = tok.chat_template is not None and "tools" in tok.chat_template
    tool_format = (infer_tool_format(tok.chat_template, tok.vocab) if native else None) or HERMES_FORMAT
    places = tok.chat_template is not None and "reasoning_content" in tok.chat_template
    return Traits(think_markers(tok.vocab), native, tool_format, places)


def current_turn_reasoning(items: list[Item]) -> list[Item]:
    """``reasoning.context: "current_turn"``: the reasoning items after the last user message
    only (those of earlier turns are not rendered)."""
    users = [i for i, item in enumerate(items) if isinstance(item, MessageItem) and item.role == "user"]
    last = users[-1] if users else 0
    return [item for i, item in enumerate(items) if i >= last or not isinstance(item, ReasoningItem)]


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each system message after the conversation began folded into the
    nearest user turn: the next one (before its text), else the one before (after its text),
    else made a user turn itself. For templates that refuse a system message there (many
    raise "System role not supported" or "roles must alternate"); Claude Code sends its
    environment as one (docs/messages.md, "Messages")."""
    start = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    out = [dict(m) for m in messages]
    for i in range(len(out) - 1, start - 1, -1):
        if out[i]["role"] != "system":
            continue
        text = out[i]["content"]
        after = next((j for j in range(i + 1, len(out)) if out[j]["role"] == "user"), None)
        before = next((j for j in range(i - 1, -1, -1) if out[j]["role"] == "user"), None)
        if after is not None:
            out[after]["content"] = f"{text}\n\n{out[after]['content']}"
        elif before is not None:
            out[before]["content"] = f"{out[before]['content']}\n\n{text}"
        else:
            out[i] = {"role": "user", "content": text}
            continue
        del out[i]
    return out


def _render(tok: Tokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    """The chat template's rendering; where it refuses, and mid-conversation system messages may
    be why, rendered again with them folded into user turns (the first refusal stands if that
    is refused too)."""
    try:
        return tok.render_chat(messages, **kwargs)
    except InvalidRequestError:
        folded = fold_system(messages)
        if folded == messages:
            raise
        try:
            return tok.render_chat(folded, **kwargs)
        except InvalidRequestError:
            pass
        raise


def build_prompt(
    tok: Tokenizer,
    request: ResponseRequest,
    history: list[Item],
    after: list[Item] | None = None,
    parsed: Directives | None = None,
) -> Prompt:
    """``after``: items that follow the request's own (a compaction item made for this turn);
    ``parsed``: the request's directives as intake carries them (None: parsed from it here)."""
    parsed = parsed or directives_of(request)
    options = parsed.tools
    model = traits(tok)
    think, native, tool_format = model.think, model.native_tools, model.tool_format
    expanded = expand([*history, *request.items(), *(after or [])])
    # Reasoning goes inline only where the template cannot place it: never twice.
    inline = None if model.places_reasoning else think
    items = expanded.items
    if parsed.reasoning is not None and parsed.reasoning.context == "current_turn":
        items = current_turn_reasoning(items)
    writer = CUSTOM_CALLS.get(tool_format, hermes_custom_call)
    messages = to_messages(items, native_tools=native, think=inline, custom_call=writer)
    kwargs = dict(request.chat_template_kwargs or {})
    system = fold_summary(request.instructions, expanded.summary)
    custom = customs(options.tools) if options.active else []
    syntax = grammar.SYNTAXES.get(tool_format)
    if custom and (syntax is None or syntax.custom is None):
        raise InvalidRequestError(
            f"custom tools cannot be offered to this model: its tool-call format ({tool_format}) has no way to "
            "carry raw input; use a function tool",
            param=f"{options.param(custom[0])}.type",
        )
    if options.active:
        block = None
        if native:
            kwargs["tools"] = [_chat_tool(t) for t in functions(options.tools)]
            block = _custom_block(custom, tool_format) if custom else None
        else:
            block = _hermes_block(functions(options.tools), custom)
        if block:
            system = f"{system}\n\n{block}" if system else block
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    try:
        text = _render(tok, messages, kwargs)
    except InvalidRequestError as exc:
        if request.chat_template_kwargs and "chat template error" not in exc.message:
            raise InvalidRequestError(exc.message, param="chat_template_kwargs") from exc
        raise
    reasoning_open = think is not None and text.rstrip().endswith(think[0])
    parse_format = tool_format if options.active else None
    if options.active and options.choice != "auto" and tool_format not in grammar.SYNTAXES:
        # Forcing a call needs its syntax as a grammar; never answer as if it were enforced.
        raise InvalidRequestError(
            f"tool_choice {options.choice!r} cannot be enforced for this model's tool-call format "
            f"({tool_format}); use 'auto'",
            param="tool_choice",
        )
    lark = grammar.build(
        text_format=parsed.text_format,
        tools=options,
        tool_format=parse_format,
        special=tok.special_tokens,
        think_end=think[1] if think is not None and reasoning_open else None,
    )
    param = grammar.grammar_param(parsed.text_format, options)
    return Prompt(text, parse_format, options, think, reasoning_open, lark, param)
