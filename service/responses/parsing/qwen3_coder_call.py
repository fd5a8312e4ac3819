"""Qwen3-Coder's XML-style tool calls, streamed as the JSON object they stand for."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import regex

from lmspd.responses.parsing.call_formats import Args, Close, Open, Scanner, Whole, escape, find_first, held

_XML_NAME = regex.compile(r"\s*([^\s<>]*)")


class Qwen3Coder(Scanner):
    """``<function=NAME><parameter=P>VALUE</parameter>...</function>``, streamed as a JSON object.

    String parameters stream as JSON strings; other values are converted by the
    family's own rules when their parameter closes, so the streamed text equals
    ``json.dumps`` of what ``parse_tool_call`` yields.
    """

    FUNCTION, PARAMETER, PARAMETER_END, FUNCTION_END = "<function=", "<parameter=", "</parameter>", "</function>"

    def __init__(
        self, module: ModuleType, tools: list[dict[str, Any]] | None, custom: frozenset[str] = frozenset()
    ) -> None:
        super().__init__()
        self._module, self._tools, self._custom = module, tools, custom
        # A custom tool's call: its one parameter's value is the raw input, streamed as it is.
        self._raw: list[str] | None = None
        self._state = "pre"
        self._opened = False
        self._config: dict[str, Any] = {}
        self._param = ""
        self._first = True
        self._as_string = False
        self._lead_seen = False
        self._quoted = False
        self._value = ""

    def step(self, view: str, final: bool) -> int | None:
        state = self._state
        if state == "pre":
            return self._seek(view, final, (self.FUNCTION,))
        if state in ("function", "parameter"):
            m = _XML_NAME.match(view)
            if m.end() == len(view) and not final:
                return None
            name = m.group(1)
            if not name:
                self._state = "rest" if state == "function" else "skip"
                return 0
            n = m.end() + (view[m.end() : m.end() + 1] == ">")
            if state == "function":
                self._open(name)
            else:
                self._start_param(name)
            return self._take(view, n)
        if state == "body":
            return self._seek(view, final, (self.PARAMETER, self.FUNCTION_END))
        if state == "skip":
            return self._seek(view, final, (self.PARAMETER_END,))
        if state == "value":
            i = view.find(self.PARAMETER_END)
            n = i if i >= 0 else len(view) - (0 if final else held(view, (self.PARAMETER_END,)))
            self._add_value(view[:n])
            if i < 0:
                return self._take(view, n) or None
            self._end_value()
            self._state = "body"
            return self._take(view, n + len(self.PARAMETER_END))
        return self._take(view, len(view)) or None

    def close(self, tail: str) -> None:
        self._parts.append(tail)
        if self._raw is not None:
            self.events.append(Close("".join(self._raw)))
            return
        self.events.append(Close(self.body) if self._opened else Whole(self.body))

    def _seek(self, view: str, final: bool, markers: tuple[str, ...]) -> int | None:
        hit = find_first(view, markers)
        if hit is None:
            return self._take(view, len(view) - (0 if final else held(view, markers))) or None
        i, marker = hit
        if marker == self.FUNCTION:
            self._state = "function"
        elif marker == self.PARAMETER:
            self._state = "parameter"
        elif marker == self.FUNCTION_END:
            if self._raw is None:
                self.events.append(Args("}"))
            self._state = "done"
        else:
            self._state = "body"
        return self._take(view, i + len(marker))

    def _open(self, name: str) -> None:
        self._opened = True
        self._state = "body"
        if name in self._custom:
            self._raw = []
            self.events.append(Open(name))
            return
        self._config = self._module._get_arguments_config(name, self._tools)
        self.events.extend((Open(name), Args("{")))

    def _start_param(self, name: str) -> None:
        if self._raw is not None:  # the value as a string parameter's is, not typed
            self._param, self._lead_seen, self._value, self._state = name, False, "", "value"
            return
        sep = "" if self._first else ", "
        self._first = False
        self.events.append(Args(f"{sep}{json.dumps(name, ensure_ascii=False)}: "))
        param = self._config.get(name)
        # Mirrors qwen3_coder._convert_param_value: undeclared parameters stay strings.
        self._as_string = not param or (
            "type" in param and str(param["type"]).strip().lower() in self._module._string_types
        )
        self._param, self._lead_seen, self._quoted, self._value = name, False, False, ""
        self._state = "value"

    def _add_value(self, chunk: str) -> None:
        if self._raw is not None:
            self._add_raw(chunk)
            return
        if not self._as_string:
            self._value += chunk
            return
        if chunk and not self._lead_seen:
            self._lead_seen = True
            chunk = chunk.removeprefix("\n")
        self._value += chunk
        # A final newline belongs to the markup, and "null" (any case) becomes JSON null.
        ready = self._value.removesuffix("\n")
        if not self._quoted:
            if "null".startswith(ready.lower()):
                return
            self._quoted = True
            self.events.append(Args('"'))
        if ready:
            self.events.append(Args(escape(ready)))
            self._value = self._value[len(ready) :]

    def _add_raw(self, chunk: str) -> None:
        """A custom call's input: the value without the newlines that wrap every value."""
        assert self._raw is not None
        if chunk and not self._lead_seen:
            self._lead_seen = True
            chunk = chunk.removeprefix("\n")
        self._value += chunk
        ready = self._value.removesuffix("\n")  # held: the markup's, if the value ends here
        if ready:
            self._raw.append(ready)
            self.events.append(Args(ready))
            self._value = self._value[len(ready) :]

    def _end_value(self) -> None:
        if self._raw is not None:
            return  # its held newline is the markup's
        value = self._value
        if self._quoted:
            self.events.append(Args(escape(value.removesuffix("\n")) + '"'))
            return
        if not self._as_string:
            value = value.removeprefix("\n")
        value = value.removesuffix("\n")
        try:
            text = json.dumps(self._module._convert_param_value(value, self._param, self._config), ensure_ascii=False)
        except Exception:
            return  # the authoritative parse fails the same way, so the call ends up invalid
        self.events.append(Args(text))
