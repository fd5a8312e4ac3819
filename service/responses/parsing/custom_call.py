"""A custom (freeform) tool's call in a Hermes ``<tool_call>`` block: its name alone on the
block's first line, then its input as raw text up to the end marker (docs/responses.md,
"Custom tools"). The grammar (lmspd.prompting.grammar.custom_input) keeps the end marker
out of the input, so the first one ends it, as here."""

from __future__ import annotations

import regex

from lmspd.responses.parsing.call_formats import ARGUMENTS_KEY, HERMES_HEAD, Args, Close, JsonCall, Open, Scanner

# The name line of a custom tool's call (a namespaced tool's name is "ns.name").
CUSTOM_HEAD = regex.compile(r"[ \t\r\n]*([A-Za-z0-9_.-]+)\n")


class RawInput(Scanner):
    """A custom tool's input: the raw text up to the block's end marker, streamed as generated
    (docs/responses.md, "Custom tools": nothing between them belongs to the markup)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.events.append(Open(name))

    def step(self, view: str, final: bool) -> int | None:
        if view:
            self.events.append(Args(view))
        return self._take(view, len(view)) or None

    def close(self, tail: str) -> None:
        if tail:
            self.events.append(Args(tail))
            self._parts.append(tail)
        self.events.append(Close(self.body))


class HermesBlock(Scanner):
    """A Hermes ``<tool_call>`` block when custom tools are offered: a JSON call, or a custom
    tool's name alone on the first line and then its raw input (:class:`RawInput`)."""

    def __init__(self, custom: frozenset[str]) -> None:
        super().__init__()
        self._custom = custom
        self._inner: Scanner | None = None

    @property
    def in_json(self) -> bool:
        return self._inner is not None and self._inner.in_json

    def step(self, view: str, final: bool) -> int | None:
        n: int | None = 0
        if self._inner is None:
            m = CUSTOM_HEAD.match(view, partial=True)
            if m is not None and m.partial and not final:
                return None
            if m is not None and not m.partial and m.group(1) in self._custom:
                self._inner, n = RawInput(m.group(1)), m.end()
            else:  # a JSON call begins with "{": no name line can be read as one
                self._inner = JsonCall(HERMES_HEAD, ARGUMENTS_KEY, wait_end=True)
        else:
            n = self._inner.step(view, final)
        self._lift()
        return n

    def close(self, tail: str) -> None:
        if self._inner is None:
            self._inner = JsonCall(HERMES_HEAD, ARGUMENTS_KEY, wait_end=True)
        self._inner.close(tail)
        self._lift()

    def _lift(self) -> None:
        assert self._inner is not None
        self.events.extend(self._inner.events)
        self._inner.events.clear()
        self.finished = self._inner.finished
