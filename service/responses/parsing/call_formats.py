"""Incremental scanners for the text of one tool-call block, one per call syntax.

A scanner sees the text after its family's call marker (and before the end
marker, for families that have one) in whatever chunks generation produced, and
reports what it learns as events. Every decision depends only on the text seen
so far, never on where it was cut, so a parser rebuilt from the whole text ends
up in the same state as one fed token by token.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import regex


@dataclass(frozen=True)
class Open:
    name: str


@dataclass(frozen=True)
class Args:
    text: str


@dataclass(frozen=True)
class Close:
    """The open call is complete; ``text`` is what the family's parser reads."""

    text: str


@dataclass(frozen=True)
class Whole:
    """A block that could not be streamed: ``text`` is parsed all at once."""

    text: str


@dataclass(frozen=True)
class Abort:
    """Not a call after all: the block's text is message text."""


Event = Open | Args | Close | Whole | Abort

JSON_WS = " \t\r\n"
PYTHON_TAG = "<|python_tag|>"
_NAME_FIELD = r'"name"\s*:\s*("(?:[^"\\]|\\.)*")'
HERMES_HEAD = regex.compile(r"\s*\{\s*" + _NAME_FIELD)
LLAMA_HEAD = regex.compile(r"[\s;]*(?:<\|python_tag\|>)?\s*\{\s*" + _NAME_FIELD)
MISTRAL_HEAD = regex.compile(r"\s*([\w-]+)\s*\[ARGS\]")
ARGUMENTS_KEY = regex.compile(r'\s*,\s*"arguments"\s*:')
PARAMETERS_KEY = regex.compile(r'\s*,\s*"(?:parameters|arguments)"\s*:')
_LIST_NEXT = regex.compile(r"\s*([,\]])")


def held(text: str, markers: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the start of a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, marker)
    return best


def escape(text: str) -> str:
    """``text`` as the inside of a JSON string; escaping is per character, so pieces concatenate."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class JsonEnd:
    """Finds where a JSON value ends, aware of strings and escapes, without parsing it."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.in_string = False
        self.escaped = False
        self.scalar = False

    def scan(self, text: str) -> int | None:
        """Index just past the value's end in ``text`` (a scalar ends before its delimiter), or None."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif self.scalar:
                if c in ",}]" or c in JSON_WS:
                    return i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0:
                    return i
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.depth == 0 and c not in JSON_WS:
                self.scalar = True
        return None


class Scanner(ABC):
    """What an output parser drives for one call block: ``step`` through its text as it is
    generated, ``close`` at its end; the calls found go to ``events``. Each family's scanner
    supplies ``step`` and ``close``."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.finished = False
        self._parts: list[str] = []

    @property
    def body(self) -> str:
        return "".join(self._parts)

    @property
    def in_json(self) -> bool:
        """The text so far ends inside a JSON value, where a marker's text is content."""
        return False

    @abstractmethod
    def step(self, view: str, final: bool) -> int | None:
        """Consume from ``view``; None when nothing can be decided without more text."""

    @abstractmethod
    def close(self, tail: str) -> None:
        """The block ended (end marker or end of generation); ``tail`` is its unconsumed rest."""

    def _take(self, view: str, n: int) -> int:
        if n:
            self._parts.append(view[:n])
        return n


class Buffered(Scanner):
    """Families whose calls are not streamed: the block is parsed when it ends."""

    def step(self, view: str, final: bool) -> int | None:
        return self._take(view, len(view)) or None

    def close(self, tail: str) -> None:
        self._parts.append(tail)
        self.events.append(Whole(self.body))


class JsonCall(Scanner):
    """One call written as JSON: a head naming the function, then the arguments value streamed as generated.

    ``key`` matches what lies between the name and the arguments (None when the
    head already ends there); ``wrapped`` calls end where their wrapper object
    closes, others where the arguments value ends. ``wait_end`` calls are only
    complete at the family's end marker, whose absence (at the end of
    generation) leaves them to the authoritative parse. A ``speculative`` call
    is plain text unless its head matches.
    """

    def __init__(
        self,
        head: Any,
        key: Any,
        *,
        json_name: bool = True,
        wrapped: bool = True,
        wait_end: bool = False,
        speculative: bool = False,
        wrap: tuple[str, str] = ("", ""),
    ) -> None:
        super().__init__()
        self._head, self._key, self._json_name = head, key, json_name
        self._wrapped, self._wait_end, self._speculative, self._wrap = wrapped, wait_end, speculative, wrap
        self._state = "head"
        self._opened = False
        self._streaming = False
        self._end = JsonEnd()

    @property
    def in_json(self) -> bool:
        return self._state in ("value", "tail")

    def step(self, view: str, final: bool) -> int | None:
        state = self._state
        if state == "head":
            return self._step_head(view, final)
        if state == "key":
            m = self._key.match(view, partial=True)
            if m is not None and m.partial and not final:
                return None
            # Another layout (extra keys, other order) is still parsed, just not streamed.
            self._state, self._end = ("ws", JsonEnd()) if m is not None and not m.partial else ("tail", JsonEnd(1))
            return self._take(view, m.end() if self._state == "ws" else 0)
        if state == "ws":
            k = len(view) - len(view.lstrip(JSON_WS))
            if k == len(view):
                return self._take(view, k) or None
            self._streaming = view[k] == "{"
            self._state = "value"
            return self._take(view, k)
        if state in ("value", "tail"):
            end = self._end.scan(view)
            n = len(view) if end is None else end
            if state == "value" and self._streaming and n:
                self.events.append(Args(view[:n]))
            self._take(view, n)
            if end is None:
                return n or None
            if state == "value" and self._wrapped:
                self._state, self._end = "tail", JsonEnd(1)
            elif self._wait_end:
                self._state = "done"
            else:
                self.events.append(Close(self._wrap[0] + self.body + self._wrap[1]))
                self.finished = True
            return n
        return self._take(view, len(view)) or None

    def _step_head(self, view: str, final: bool) -> int | None:
        m = self._head.match(view, partial=True)
        if m is not None and m.partial and not final:
            return None
        name: str | None = None
        if m is not None and not m.partial:
            try:
                name = json.loads(m.group(1)) if self._json_name else m.group(1)
            except ValueError:
                name = None
        if name is None:
            if self._speculative:
                self.events.append(Abort())
                self.finished = True
            else:
                self._state = "rest"
            return 0
        self._opened = True
        self.events.append(Open(name))
        self._state = "key" if self._key is not None else "ws"
        return self._take(view, m.end())

    def close(self, tail: str) -> None:
        self._parts.append(tail)
        if self._opened:
            self.events.append(Close(self._wrap[0] + self.body + self._wrap[1]))
        elif self._speculative:
            self.events.append(Abort())
        else:
            self.events.append(Whole(self._wrap[0] + self.body))


class MistralCalls(Scanner):
    """``name[ARGS]{...}`` or the list form ``[{"name": ..., "arguments": {...}}, ...]``."""

    def __init__(self) -> None:
        super().__init__()
        self._inner: Scanner | None = None
        self._state = "decide"

    def step(self, view: str, final: bool) -> int | None:
        if self._state == "decide":
            rest = view.lstrip(JSON_WS)
            if not rest:
                return None
            if rest[0] == "[":
                self._state, self._inner = "list", _list_element()
                return len(view) - len(rest) + 1
            self._state, self._inner = "head", JsonCall(MISTRAL_HEAD, None, json_name=False, wrapped=False)
            return 0
        if self._state == "next":
            m = _LIST_NEXT.match(view, partial=True)
            if m is not None and m.partial and not final:
                return None
            if m is None or m.partial or m.group(1) == "]":
                self.finished = True
                return int(m.end()) if m is not None and not m.partial else 0
            self._state, self._inner = "list", _list_element()
            return int(m.end())
        assert self._inner is not None
        n = self._inner.step(view, final)
        self._lift()
        if self._inner.finished:
            self._state = "next" if self._state == "list" else "done"
            self.finished = self._state == "done"
        return n

    def close(self, tail: str) -> None:
        if self._inner is not None and not self._inner.finished:
            self._inner.close(tail)
            self._lift()
        elif self._state == "decide":
            self.events.append(Whole(tail))

    def _lift(self) -> None:
        assert self._inner is not None
        self.events.extend(self._inner.events)
        self._inner.events.clear()


def _list_element() -> JsonCall:
    return JsonCall(HERMES_HEAD, ARGUMENTS_KEY, wrap=("[", "]"))


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools in the Chat Completions shape mlx_lm's parsers read."""
    out: list[dict[str, Any]] = []
    for tool in tools:
        if isinstance(tool.get("function"), dict):
            out.append(tool)
        elif tool.get("type", "function") == "function" and isinstance(tool.get("name"), str):
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": function})
    return out


def parse_llama3_json(text: str) -> dict[str, Any]:
    """One Llama 3.x JSON call, ``{"name": ..., "parameters": {...}}``."""
    text = text.strip().lstrip(";").strip().removeprefix(PYTHON_TAG)
    call = json.loads(text)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError(f"not a tool call: {text}")
    arguments = call.get("parameters", call.get("arguments", {}))
    return {"name": call["name"], "arguments": arguments}


def json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
