"""Split a model's generated text, delta by delta, into message text, reasoning and tool calls.

Tool-call arguments stream while they are generated; when a call closes, the
family's own mlx_lm parser (``mlx_lm.tool_parsers.<format>``) has the last word.
Nothing here depends on how the text was cut into deltas: feeding the same text
in any chunks gives the same calls, the same text and the same state, which is
how a restarted generation rebuilds its parser from the text so far.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from lmspd.engine.upstream.parsers import infer_mlx_thinking, infer_mlx_tool_parser, parser_module
from lmspd.responses.parsing.call_formats import (
    ARGUMENTS_KEY,
    HERMES_HEAD,
    LLAMA_HEAD,
    MISTRAL_HEAD,
    PARAMETERS_KEY,
    PYTHON_TAG,
    Abort,
    Args,
    Buffered,
    Close,
    JsonCall,
    MistralCalls,
    Open,
    Scanner,
    Whole,
    chat_tools,
    find_first,
    held,
    json_value,
    parse_llama3_json,
)
from lmspd.responses.parsing.custom_call import HermesBlock
from lmspd.responses.parsing.qwen3_coder_call import Qwen3Coder


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str
    custom: bool = False  # a custom tool's call: its deltas and arguments are raw input


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    delta: str


@dataclass(frozen=True)
class CallDone:
    index: int
    name: str
    arguments: str  # a custom call's raw input
    valid: bool
    custom: bool = False


Piece = TextDelta | ReasoningDelta | CallStarted | ArgumentsDelta | CallDone

STREAMING_FORMATS = frozenset({"json_tools", "mistral", "llama3_json", "qwen3_coder"})
LLAMA3_JSON = "llama3_json"


def infer_tool_format(chat_template: str | None, vocab: Mapping[str, int]) -> str | None:
    """mlx_lm's own choice of tool parser, plus Llama 3.x's JSON calls (which mlx_lm does not parse)."""
    found = infer_mlx_tool_parser(chat_template, vocab)
    if found is not None or not chat_template:
        return found
    llama = "<|eot_id|>" in chat_template or "<|start_header_id|>" in chat_template
    if llama and (PYTHON_TAG in chat_template or '"parameters": ' in chat_template):
        return LLAMA3_JSON
    return None


def think_markers(vocab: Mapping[str, int]) -> tuple[str, str] | None:
    return infer_mlx_thinking(vocab)


@dataclass
class _Call:
    index: int
    name: str
    custom: bool = False
    streamed: list[str] = field(default_factory=list)


class OutputParser:
    """Feed the generated text as it comes (``feed``), then ``finish`` when generation ends.

    ``tool_format`` names an ``mlx_lm.tool_parsers`` module (or ``llama3_json``);
    None reads everything outside reasoning as message text. ``tools`` (Responses
    function tools) type Qwen3-Coder's values, and a call of a function not among
    them is text. ``reasoning``: the prompt opened a reasoning block (with
    ``think``'s markers, ``<think>``/``</think>`` when not given). ``bound``: a grammar
    writes the calls, so they are read as it wrote them (an end marker's text inside a
    JSON string is part of the string, not the end of the call). ``custom``: the names of
    custom tools, whose calls carry raw input (``json_tools``:
    :class:`~lmspd.responses.parsing.custom_call.HermesBlock`; ``qwen3_coder``: one parameter).
    """

    def __init__(
        self,
        *,
        tool_format: str | None,
        tools: list[dict[str, Any]] | None = None,
        reasoning: bool = False,
        think: tuple[str, str] | None = None,
        max_calls: int | None = None,
        bound: bool = False,
        custom: Collection[str] = (),
    ) -> None:
        self._format = tool_format
        self._module: ModuleType | None = None
        if tool_format is not None and tool_format != LLAMA3_JSON:
            self._module = parser_module(tool_format)
        self._tools = chat_tools(tools) if tools is not None else None
        self._custom = frozenset(custom)
        self._names = {t["function"]["name"] for t in self._tools} | self._custom if self._tools is not None else None
        if reasoning and think is None:
            think = ("<think>", "</think>")
        self._think = think
        self._max_calls = max_calls
        self._bound = bound
        # A grammar lets a reasoning block the prompt opened run to its closing marker, and only
        # then the calls: a call marker inside it is reasoning text.
        self._calls_in_reasoning = not (bound and reasoning)
        self._starts: tuple[str, ...] = ()
        self._end = ""
        if tool_format == LLAMA3_JSON:
            self._starts = (PYTHON_TAG,)
        elif self._module is not None:
            self._starts = (self._module.tool_call_start,)
            self._end = self._module.tool_call_end  # Mistral has none: its calls end with their JSON
        # Families whose calls need no marker at a call boundary (Llama: at the start; Mistral: after a call).
        self._marker_free = tool_format in (LLAMA3_JSON, "mistral")
        self._mode = "reasoning" if reasoning else ("start" if think is not None else "text")
        self._lead = reasoning  # drop leading whitespace of this reasoning or message segment
        self._boundary = tool_format == LLAMA3_JSON
        self._buf = ""
        self._out: list[Piece] = []
        self._count = 0
        self._scanner: Scanner | None = None
        self._raw: list[str] = []  # the block's text so far, markers included
        self._announced = False
        self._call: _Call | None = None
        self._ended = False  # the block closed at its end marker (not at the end of generation)

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Piece]:
        handlers = {"start": self._at_start, "reasoning": self._in_reasoning, "text": self._in_text}
        while True:
            handler = self._in_block if self._scanner is not None else handlers[self._mode]
            n = handler(self._buf, final)
            if n is None:
                break
            if n:
                self._buf = self._buf[n:]
        out, self._out = self._out, []
        return out

    def _strip_lead(self, buf: str) -> int | None:
        """Whitespace to drop at the start of a segment; None once the segment has begun."""
        if not self._lead:
            return None
        k = len(buf) - len(buf.lstrip())
        if k or not buf:
            return k
        self._lead = False
        return None

    def _at_start(self, buf: str, final: bool) -> int | None:
        assert self._think is not None
        opening = self._think[0]
        rest = buf.lstrip()
        if rest.startswith(opening):
            self._mode, self._lead = "reasoning", True
            return len(buf) - len(rest) + len(opening)
        if not final and opening.startswith(rest):
            return None
        self._mode = "text"
        return 0

    def _in_reasoning(self, buf: str, final: bool) -> int | None:
        assert self._think is not None
        k = self._strip_lead(buf)
        if k is not None:
            return k or None
        closing = self._think[1]
        markers = (closing, *self._starts) if self._calls_in_reasoning else (closing,)
        hit = find_first(buf, markers)
        if hit is not None:
            i, marker = hit
            self._emit(ReasoningDelta(buf[:i]))
            if marker == closing:
                self._mode, self._lead, self._boundary = "text", True, self._format == LLAMA3_JSON
            else:
                self._begin(marker, after_call=False)
            return i + len(marker)
        n = len(buf) if final else len(buf) - held(buf, markers)
        self._emit(ReasoningDelta(buf[:n]))
        return n or None

    def _in_text(self, buf: str, final: bool) -> int | None:
        k = self._strip_lead(buf)
        if k is not None:
            return k or None
        if self._boundary:
            if not buf and not final:
                return None  # feeding nothing must not change the state
            self._boundary = False
            self._begin("", after_call=True)
            return 0
        hit = find_first(buf, self._starts)
        if hit is not None:
            i, marker = hit
            text = buf[:i].rstrip()
            self._emit(TextDelta(text))
            # Templates put a separator between the content and the calls; it is text again if no call follows.
            self._begin(buf[len(text) : i] + marker, after_call=False)
            return i + len(marker)
        n = len(buf) if final else len(buf) - held(buf, self._starts)
        if self._starts and not final:
            n = len(buf[:n].rstrip())
        self._emit(TextDelta(buf[:n]))
        return n or None

    def _begin(self, marker: str, *, after_call: bool) -> None:
        self._mode = "text"
        self._scanner = self._new_scanner(after_call)
        self._raw, self._announced = [marker], False

    def _new_scanner(self, after_call: bool) -> Scanner:
        """``after_call``: right after a call, where Mistral needs no marker for the next one."""
        if self._format == "json_tools":
            return HermesBlock(self._custom) if self._custom else JsonCall(HERMES_HEAD, ARGUMENTS_KEY, wait_end=True)
        if self._format == LLAMA3_JSON:
            return JsonCall(LLAMA_HEAD, PARAMETERS_KEY, speculative=True)
        if self._format == "mistral":
            if after_call:
                return JsonCall(MISTRAL_HEAD, None, json_name=False, wrapped=False, speculative=True)
            return MistralCalls()
        if self._format == "qwen3_coder" and self._module is not None:
            return Qwen3Coder(self._module, self._tools, self._custom)
        return Buffered()

    def _in_block(self, buf: str, final: bool) -> int | None:
        scanner = self._scanner
        assert scanner is not None
        # The grammar lets a JSON string hold any text, "</tool_call>" too: under it, the
        # marker ends the block only once the JSON around it has ended. (Cut there, the rest
        # of the string would read as message text, and the call as broken.)
        literal = self._bound and scanner.in_json
        found = buf.find(self._end) if self._end and not literal else -1
        if found >= 0:
            view = buf[:found]
        else:
            view = buf if final or not self._end or literal else buf[: len(buf) - held(buf, (self._end,))]
        n = scanner.step(view, final or found >= 0)
        if n:
            self._raw.append(view[:n])
        self._handle(scanner)
        if self._scanner is None or scanner.finished:
            if self._scanner is not None:
                self._end_block()
            return n or 0
        if n is not None:
            return n
        if found < 0 and not final:
            return None
        marker = self._end if found >= 0 else ""
        self._ended = found >= 0
        self._raw += [view, marker]
        scanner.close(view)
        self._handle(scanner)
        if self._scanner is not None:
            self._end_block()
        return len(view) + len(marker)

    def _handle(self, scanner: Scanner) -> None:
        events, scanner.events = scanner.events, []
        for event in events:
            if isinstance(event, Open):
                if self._names is not None and event.name not in self._names:
                    self._as_text()
                    return
                self._open(event.name)
            elif isinstance(event, Args):
                self._stream(event.text)
            elif isinstance(event, Close):
                if self._call is not None and self._call.custom:
                    self._close_custom(event.text)
                else:
                    self._close(self._parse(event.text))
            elif isinstance(event, Whole):
                self._whole(event.text)
            elif isinstance(event, Abort):
                self._as_text()
            if self._scanner is None:
                return

    def _as_text(self) -> None:
        """The block is not a call: its text so far is message text (unless a call of it was announced)."""
        if not self._announced:
            self._emit(TextDelta("".join(self._raw)))
        self._scanner, self._call, self._lead, self._boundary = None, None, False, False

    def _end_block(self) -> None:
        self._scanner, self._call = None, None
        self._lead, self._boundary = True, self._marker_free

    def _keep(self, index: int) -> bool:
        return self._max_calls is None or index < self._max_calls

    def _open(self, name: str) -> None:
        self._call = _Call(self._count, name, name in self._custom)
        self._count += 1
        self._announced = True
        if self._keep(self._call.index):
            self._out.append(CallStarted(self._call.index, name, self._call.custom))

    def _stream(self, text: str) -> None:
        if self._call is None or not text:
            return
        self._call.streamed.append(text)
        if self._keep(self._call.index):
            self._out.append(ArgumentsDelta(self._call.index, text))

    def _close(self, parsed: list[tuple[str, dict[str, Any]]] | None) -> None:
        call = self._call
        if call is None:
            return
        streamed = "".join(call.streamed)
        valid = parsed is not None
        if parsed is not None and json_value(streamed) != parsed[0][1]:
            arguments = json.dumps(parsed[0][1], ensure_ascii=False)
            if arguments.startswith(streamed):
                self._stream(arguments[len(streamed) :])
            streamed = arguments
        self._call = None
        if self._keep(call.index):
            self._out.append(CallDone(call.index, call.name, streamed, valid))

    def _close_custom(self, text: str) -> None:
        """A custom call's input is the raw text itself; it is whole only if its block closed."""
        call = self._call
        assert call is not None
        self._call = None
        if self._keep(call.index):
            self._out.append(CallDone(call.index, call.name, text, self._ended, custom=True))

    def _whole(self, text: str) -> None:
        parsed = self._parse(text)
        if parsed is None or (self._names is not None and any(name not in self._names for name, _ in parsed)):
            self._as_text()
            return
        for name, arguments in parsed:
            self._open(name)
            self._stream(json.dumps(arguments, ensure_ascii=False))
            self._close([(name, arguments)])

    def _parse(self, text: str) -> list[tuple[str, dict[str, Any]]] | None:
        """The family's authoritative parse: each call's name and arguments, or None if it does not parse."""
        try:
            if self._format == LLAMA3_JSON:
                result: Any = parse_llama3_json(text)
            else:
                assert self._module is not None
                result = self._module.parse_tool_call(text, self._tools)
            calls: list[tuple[str, dict[str, Any]]] = []
            for call in result if isinstance(result, list) else [result]:
                name, arguments = call["name"], call.get("arguments", {})
                if isinstance(arguments, str):  # some templates render the arguments as a JSON string
                    arguments = json.loads(arguments)
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    return None
                json.dumps(arguments, ensure_ascii=False)  # arguments must be JSON (not, say, a Python set)
                calls.append((name, arguments))
        except Exception:
            return None
        return calls or None

    def _emit(self, piece: TextDelta | ReasoningDelta) -> None:
        if piece.text:
            self._out.append(piece)
