"""``lmspd tasks watch``: a task's events shown to a person, live, across reconnects and restarts.

stdout carries the output text and nothing else when it is not a terminal (so it can be piped or
compared); notices and the final summary go to stderr. On a terminal a rich live view shows the
tail of the text with a status line, then the whole text and the summary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TextIO

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.segment import Segment
from rich.text import Text

from lmspd.client.http import FINAL_EVENTS, Json, TaskClient

TEXT_DELTA = "response.output_text.delta"
TOKEN_EVENTS = frozenset(
    {
        TEXT_DELTA,
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
    }
)
CALL_TYPES = ("function_call", "custom_tool_call")
RESTARTED = "lmsp.attempt.restarted"
# A span shorter than this is a replay of events already generated, not a speed worth showing.
MIN_RATE_SPAN = 0.5


@dataclass
class TaskView:
    """What a task's events say so far. ``apply`` them in order; the output text is that of the
    current attempt (``lmsp.attempt.restarted`` discards what came before, as docs/lmsp.md §6.3 says)."""

    task_id: str
    status: str = "waiting"
    attempt: int = 1
    tokens: int = 0  # generated in this attempt: token deltas until the final usage says exactly
    restarts: int = 0
    reconnects: int = 0  # times the stream went down and was resumed (or is being resumed)
    connection: str | None = None  # why the stream is down while it is
    down_since: float | None = None
    last_seq: int | None = None
    final: Json | None = None  # the response of the final event
    calls: list[str] = field(default_factory=list)  # function calls of this attempt, name(arguments)
    _parts: list[str] = field(default_factory=list)
    _span: float = 0.0  # seconds of live token deltas, summed over connections
    _span_tokens: int = 0
    _seg_start: float | None = None
    _seg_last: float | None = None
    _seg_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def done(self) -> bool:
        return self.final is not None

    def apply(self, event: Json, now: float | None = None) -> str | None:
        """Take one event; returns the output text it adds, if any."""
        kind = event.get("type")
        self.last_seq = event.get("sequence_number", self.last_seq)
        self.connection = None
        if kind in TOKEN_EVENTS:
            self.tokens += 1
            self._tick(time.monotonic() if now is None else now)
        if kind == TEXT_DELTA:
            delta = str(event.get("delta", ""))
            self._parts.append(delta)
            return delta
        item = event.get("item")
        if kind == "response.output_item.done" and isinstance(item, dict) and item.get("type") in CALL_TYPES:
            # A custom tool's input is raw text: shown quoted, as one line.
            given = item.get("arguments") if item.get("type") == "function_call" else repr(item.get("input"))
            self.calls.append(f"{item.get('name')}({given})")
            return None
        if kind == RESTARTED:
            self._parts.clear()
            self.calls.clear()
            self.attempt = int(event.get("attempt", self.attempt + 1))
            self.restarts += 1
            self.tokens = 0
            self.status = "restarted"
            self._close_segment()
        elif isinstance(response := event.get("response"), dict):
            self.status = str(response.get("status", self.status))
            if kind in FINAL_EVENTS:
                self.final = response
                usage = response.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
                    self.tokens = usage["output_tokens"]
        return None

    def disconnected(self, why: str) -> None:
        if self.connection is None:  # a new outage, not another try in the same one
            self.reconnects += 1
            self.down_since = time.monotonic()
        self.connection = why
        self._close_segment()

    def _tick(self, now: float) -> None:
        if self._seg_start is None:
            self._seg_start = now
        else:
            self._seg_tokens += 1
        self._seg_last = now

    def _close_segment(self) -> None:
        if self._seg_start is not None and self._seg_last is not None:
            self._span += self._seg_last - self._seg_start
            self._span_tokens += self._seg_tokens
        self._seg_start = self._seg_last = None
        self._seg_tokens = 0

    def rate(self) -> float | None:
        """Tokens per second while the client watched them arrive (gaps between connections left
        out); for a task watched after the fact, the server's timestamps (whole seconds)."""
        span, tokens = self._span, self._span_tokens
        if self._seg_start is not None and self._seg_last is not None:
            span += self._seg_last - self._seg_start
            tokens += self._seg_tokens
        if span >= MIN_RATE_SPAN and tokens:
            return tokens / span
        if self.final is not None:
            created, completed = self.final.get("created_at"), self.final.get("completed_at")
            if isinstance(created, int) and isinstance(completed, int) and completed > created:
                return self.tokens / (completed - created)
        return None

    def status_line(self) -> str:
        parts = [self.task_id, self.status, f"{self.tokens} tokens"]
        if (rate := self.rate()) is not None:
            parts.append(f"{rate:.1f} tok/s")
        if self.attempt > 1:
            parts.append(f"attempt {self.attempt}")
        if self.reconnects:
            parts.append(f"{self.reconnects} reconnect{'s' if self.reconnects > 1 else ''}")
        line = " · ".join(parts)
        if self.connection:
            line += f" · reconnecting ({self.connection})"
        return line

    def summary(self) -> str:
        line = self.status_line()
        if self.final is not None and isinstance(error := self.final.get("error"), dict):
            line += f" · {error.get('code')}: {error.get('message')}"
        return line

    @property
    def succeeded(self) -> bool:
        return self.final is not None and self.final.get("status") in ("completed", "incomplete")


class _Tail:
    """The last lines of the text that fit the terminal, above the status line."""

    def __init__(self, view: TaskView) -> None:
        self.view = view

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        room = max(1, (options.height or console.size.height) - 2)
        lines = console.render_lines(Text(self.view.text), options.update(height=None), pad=False)
        for line in lines[-room:]:
            yield from line
            yield Segment.line()
        yield Text(self.view.status_line(), style="dim")


def watch(
    client: TaskClient,
    task_id: str,
    *,
    out: TextIO,
    err: TextIO,
    live: bool | None = None,
    after: int | None = None,
) -> int:
    """Follow a task to its end; 0 when it completed (or stopped at its token limit), else 1."""
    view = TaskView(task_id)
    if live is None:
        live = out.isatty()
    if live:
        _watch_live(client, view, out, err, after)
    else:
        _watch_plain(client, view, out, err, after)
    return 0 if view.succeeded else 1


def _watch_plain(client: TaskClient, view: TaskView, out: TextIO, err: TextIO, after: int | None) -> None:
    def reconnecting(why: str, delay: float, last: int | None) -> None:
        if why != view.connection:  # one line per change, not one per try while a server is down
            where = "from the start" if last is None else f"after event {last}"
            print(f"lmspd: {why}; reconnecting to resume {where}", file=err, flush=True)
        view.disconnected(why)

    for event in client.events(view.task_id, after, on_reconnect=reconnecting):
        if view.connection is not None and view.down_since is not None:
            print(f"lmspd: reconnected after {time.monotonic() - view.down_since:.1f}s", file=err, flush=True)
        delta = view.apply(event)
        if delta:
            out.write(delta)
            out.flush()
        elif event.get("type") == "response.output_item.done" and view.calls:
            if event.get("item", {}).get("type") in CALL_TYPES:
                print(f"lmspd: call {view.calls[-1]}", file=err, flush=True)
        elif event.get("type") == RESTARTED:
            print(
                f"\nlmspd: attempt {view.attempt} started over ({event.get('reason')}): discard the output above",
                file=err,
                flush=True,
            )
    print(f"lmspd: {view.summary()}", file=err, flush=True)


def _watch_live(client: TaskClient, view: TaskView, out: TextIO, err: TextIO, after: int | None) -> None:
    console = Console(file=out)
    with Live(_Tail(view), console=console, refresh_per_second=8, transient=True, redirect_stderr=False):
        for event in client.events(view.task_id, after, on_reconnect=lambda why, _d, _l: view.disconnected(why)):
            view.apply(event)
    console.print(Text(view.text))
    for call in view.calls:
        console.print(Text(f"call {call}", style="cyan"))
    style = "green" if view.succeeded else "red"
    Console(file=err).print(Text(view.summary(), style=style))
