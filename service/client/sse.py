"""An incremental parser of ``text/event-stream`` lines (the WHATWG "server-sent events" rules)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SseEvent:
    id: str | None  # the last event ID after this event (it carries over from earlier events)
    event: str  # "message" when the event names no type
    data: str


class SseParser:
    """Feed it one line at a time (without its line ending); it returns an event when a blank line
    ends one. A connection that drops mid-event leaves a partial event here that never dispatches:
    use a new parser per connection."""

    def __init__(self) -> None:
        self.last_event_id: str | None = None
        self.retry_ms: int | None = None  # the server's reconnection-time hint, if it sent one
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> SseEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):  # a comment (keep-alive)
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self.last_event_id = value
        elif name == "retry" and value.isdigit():
            self.retry_ms = int(value)
        return None  # unknown fields are ignored

    def _dispatch(self) -> SseEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return SseEvent(id=self.last_event_id, event=event or "message", data="\n".join(data))
