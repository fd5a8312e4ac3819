"""The output items of a response in progress, and the streaming events that build them.

Pieces from the output parser (message text, reasoning text, function and custom tool calls) become
items in output order: a reasoning item, a message, calls. Each item is
announced (``output_item.added``), grows by deltas and is closed (``.done`` events)
before the next one opens (docs/responses.md, "Streaming"). The state is rebuilt from the
event log with :meth:`OutputItems.replay`, so a resumed task carries on the same items.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import ulid

from lmspd.responses import schema as s
from lmspd.responses.parsing.output_parser import (
    ArgumentsDelta,
    CallDone,
    CallStarted,
    OutputParser,
    Piece,
    ReasoningDelta,
    TextDelta,
)
from lmspd.responses.tools import origin

EventFactory = Callable[[int], s._Event]
Seal = Callable[[str, str], str]  # (item id, reasoning text) -> encrypted_content
Kind = Literal["message", "function_call", "custom_tool_call", "reasoning", "compaction"]
CALLS = ("function_call", "custom_tool_call")  # the kinds the parser numbers as calls
Status = Literal["in_progress", "completed", "incomplete"]


@dataclass
class Item:
    kind: Kind
    id: str
    text: str = ""  # message text, reasoning text, call arguments or a custom call's input so far
    logprobs: list[s.LogProb] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    status: Status = "in_progress"
    calls: int = -1  # a call's ordinal from the parser
    namespace: str | None = None  # a call's namespace tool
    encrypted: str | None = None  # a closed reasoning item's sealed text (responses/sealing.py)

    def wire(self) -> s.OutputItem:
        if self.kind == "message":
            content = [] if self.status == "in_progress" else [s.OutputText(self.text, logprobs=list(self.logprobs))]
            return s.OutputMessage(id=self.id, status=self.status, content=content)
        if self.kind == "compaction":
            return s.Compaction(id=self.id, encrypted_content=self.text)
        if self.kind == "function_call":
            arguments = "" if self.status == "in_progress" else self.text
            return s.FunctionCall(
                id=self.id,
                call_id=self.call_id,
                name=self.name,
                arguments=arguments,
                status=self.status,
                namespace=self.namespace,
            )
        if self.kind == "custom_tool_call":
            return s.CustomToolCall(
                id=self.id,
                call_id=self.call_id,
                name=self.name,
                input="" if self.status == "in_progress" else self.text,
                status=self.status,
                namespace=self.namespace,
            )
        reasoning = [] if self.status == "in_progress" else [s.ReasoningText(self.text)]
        sealed = msgspec.UNSET if self.encrypted is None else self.encrypted
        return s.Reasoning(id=self.id, content=reasoning, encrypted_content=sealed)


class OutputItems:
    def __init__(self) -> None:
        self.items: list[Item] = []
        self.parser: OutputParser | None = None
        self._pending_logprobs: list[s.LogProb] = []
        self._namespaces: Mapping[str, str] = {}
        self._seal: Seal | None = None

    # --- rebuilding -------------------------------------------------------------------------

    def attach(
        self,
        parser: OutputParser,
        generated_text: str,
        namespaces: Mapping[str, str] | None = None,
        seal: Seal | None = None,
    ) -> None:
        """Read the output from here on with ``parser``, which first catches up with the
        text generated so far (its pieces are already in the log). ``namespaces``: the
        namespace of each tool the model knows by a qualified name (``ToolOptions.namespaces``);
        ``seal``: seals each reasoning item as it closes (``include`` asked for it)."""
        parser.feed(generated_text)
        self.parser = parser
        self._namespaces = namespaces or {}
        self._seal = seal

    def replay(self, event: s._Event) -> None:
        if isinstance(event, s.OutputItemAdded):
            item = event.item
            if isinstance(item, s.FunctionCall | s.CustomToolCall):
                calls = sum(1 for i in self.items if i.kind in CALLS)
                self.items.append(
                    Item(
                        "custom_tool_call" if isinstance(item, s.CustomToolCall) else "function_call",
                        item.id,
                        call_id=item.call_id,
                        name=item.name,
                        calls=calls,
                        namespace=item.namespace,
                    )
                )
            elif isinstance(item, s.Compaction):
                self.items.append(Item("compaction", item.id, text=item.encrypted_content, status="completed"))
            else:
                self.items.append(Item("message" if isinstance(item, s.OutputMessage) else "reasoning", item.id))
        elif isinstance(event, s.OutputTextDelta):
            self.items[event.output_index].text += event.delta
            self.items[event.output_index].logprobs += event.logprobs
        elif isinstance(event, s.ReasoningTextDelta | s.FunctionCallArgumentsDelta | s.CustomToolCallInputDelta):
            self.items[event.output_index].text += event.delta
        elif isinstance(event, s.FunctionCallArgumentsDone):
            self.items[event.output_index].text = event.arguments
        elif isinstance(event, s.CustomToolCallInputDone):
            self.items[event.output_index].text = event.input
        elif isinstance(event, s.OutputItemDone) and not isinstance(event.item, s.Compaction):
            self.items[event.output_index].status = event.item.status or "completed"
            if isinstance(event.item, s.Reasoning) and isinstance(event.item.encrypted_content, str):
                self.items[event.output_index].encrypted = event.item.encrypted_content

    # --- streaming --------------------------------------------------------------------------

    @property
    def open(self) -> Item | None:
        last = self.items[-1] if self.items else None
        return last if last is not None and last.status == "in_progress" else None

    def feed(self, text: str, logprobs: list[s.LogProb]) -> list[EventFactory]:
        self._pending_logprobs += logprobs
        pieces: list[Piece] = self.parser.feed(text) if self.parser else [TextDelta(text)] if text else []
        return self.apply(pieces)

    def finish(self) -> list[EventFactory]:
        return self.apply(self.parser.finish()) if self.parser else []

    def apply(self, pieces: list[Piece]) -> list[EventFactory]:
        out: list[EventFactory] = []
        for piece in pieces:
            if isinstance(piece, TextDelta):
                out += self._text(piece.text)
            elif isinstance(piece, ReasoningDelta):
                out += self._reasoning(piece.text)
            elif isinstance(piece, CallStarted):
                kind: Kind = "custom_tool_call" if piece.custom else "function_call"
                out += self._open(kind, name=piece.name, calls=piece.index)
            elif isinstance(piece, ArgumentsDelta):
                out += self._arguments(piece.index, piece.delta)
            else:
                out += self._call_done(piece)
        return out

    def _open(self, kind: Kind, *, name: str = "", calls: int = -1) -> list[EventFactory]:
        out = self.close("completed")
        prefix = {"message": "msg", "function_call": "fc", "custom_tool_call": "ctc", "reasoning": "rs"}[kind]
        item = Item(kind, f"{prefix}_{ulid.new()}", name=name, calls=calls)
        if kind in CALLS:
            item.call_id = f"call_{ulid.new()}"
            item.name, item.namespace = origin(name, self._namespaces)  # the client knows it by its own name
        self.items.append(item)
        index, added = len(self.items) - 1, item.wire()
        out.append(lambda seq: s.OutputItemAdded(sequence_number=seq, output_index=index, item=added))
        if kind == "message":
            out.append(
                lambda seq: s.ContentPartAdded(
                    sequence_number=seq, item_id=item.id, output_index=index, content_index=0, part=s.OutputText("")
                )
            )
        return out

    def add_compaction(self, item_id: str, encrypted_content: str) -> list[EventFactory]:
        """The compaction item made for this turn: complete at once, always output_index 0."""
        assert not self.items, "a compaction item comes before any other output"
        item = Item("compaction", item_id, text=encrypted_content, status="completed")
        self.items.append(item)
        wire = item.wire()
        return [
            lambda seq: s.OutputItemAdded(sequence_number=seq, output_index=0, item=wire),
            lambda seq: s.OutputItemDone(sequence_number=seq, output_index=0, item=wire),
        ]

    @property
    def compacted(self) -> bool:
        return bool(self.items) and self.items[0].kind == "compaction"

    @property
    def answered(self) -> bool:
        """Whether the model's output has any item yet (a compaction item is not one)."""
        return any(item.kind != "compaction" for item in self.items)

    def open_message(self) -> list[EventFactory]:
        return self._open("message")

    def _text(self, text: str) -> list[EventFactory]:
        out: list[EventFactory] = []
        if self.open is None or self.open.kind != "message":
            text = text.lstrip()  # whitespace between items belongs to none of them
            if not text:
                return []
            out += self._open("message")
        item, index = self.items[-1], len(self.items) - 1
        logprobs, self._pending_logprobs = self._pending_logprobs, []
        item.text += text
        item.logprobs += logprobs
        out.append(
            lambda seq: s.OutputTextDelta(
                sequence_number=seq, item_id=item.id, output_index=index, content_index=0, delta=text, logprobs=logprobs
            )
        )
        return out

    def _reasoning(self, text: str) -> list[EventFactory]:
        out: list[EventFactory] = []
        self._pending_logprobs = []  # logprobs report message text only
        if self.open is None or self.open.kind != "reasoning":
            out += self._open("reasoning")
        item, index = self.items[-1], len(self.items) - 1
        item.text += text
        out.append(
            lambda seq: s.ReasoningTextDelta(
                sequence_number=seq, item_id=item.id, output_index=index, content_index=0, delta=text
            )
        )
        return out

    def _call(self, ordinal: int) -> tuple[int, Item] | None:
        for index, item in enumerate(self.items):
            if item.kind in CALLS and item.calls == ordinal:
                return index, item
        return None

    def _arguments(self, ordinal: int, delta: str) -> list[EventFactory]:
        self._pending_logprobs = []
        found = self._call(ordinal)
        if found is None or not delta:
            return []
        index, item = found
        item.text += delta
        if item.kind == "custom_tool_call":
            return [
                lambda seq: s.CustomToolCallInputDelta(
                    sequence_number=seq, item_id=item.id, output_index=index, delta=delta
                )
            ]
        return [
            lambda seq: s.FunctionCallArgumentsDelta(
                sequence_number=seq, item_id=item.id, output_index=index, delta=delta
            )
        ]

    def _call_done(self, done: CallDone) -> list[EventFactory]:
        found = self._call(done.index)
        if found is None:
            return []
        # The parse at the end is authoritative: the streamed call receives what it lacks.
        out = (
            self._arguments(done.index, done.arguments[len(found[1].text) :])
            if done.arguments.startswith(found[1].text)
            else []
        )
        found[1].text = done.arguments
        return out + self._close_item(*found, "completed" if done.valid else "incomplete")

    def _close_item(self, index: int, item: Item, status: Status) -> list[EventFactory]:
        item.status = status
        if item.kind == "reasoning" and self._seal is not None:
            item.encrypted = self._seal(item.id, item.text)
        final = item.wire()
        out: list[EventFactory] = []
        if isinstance(final, s.OutputMessage):
            part = final.content[0]
            out += [
                lambda seq: s.OutputTextDone(
                    sequence_number=seq,
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=part.text,
                    logprobs=part.logprobs,
                ),
                lambda seq: s.ContentPartDone(
                    sequence_number=seq, item_id=item.id, output_index=index, content_index=0, part=part
                ),
            ]
        elif isinstance(final, s.FunctionCall):
            out.append(
                lambda seq: s.FunctionCallArgumentsDone(
                    sequence_number=seq, item_id=item.id, output_index=index, arguments=final.arguments
                )
            )
        elif isinstance(final, s.CustomToolCall):
            out.append(
                lambda seq: s.CustomToolCallInputDone(
                    sequence_number=seq, item_id=item.id, output_index=index, input=final.input
                )
            )
        else:
            out.append(
                lambda seq: s.ReasoningTextDone(
                    sequence_number=seq, item_id=item.id, output_index=index, content_index=0, text=item.text
                )
            )
        out.append(lambda seq: s.OutputItemDone(sequence_number=seq, output_index=index, item=final))
        return out

    def close(self, status: Status) -> list[EventFactory]:
        """Close the open item, if any. A stream that ends early (failed, cancelled)
        still gets its ``.done`` events, as clients' accumulators expect."""
        item = self.open
        if item is None:
            return []
        return self._close_item(len(self.items) - 1, item, status)

    def output(self) -> list[s.OutputItem]:
        return [item.wire() for item in self.items]

    def reset(self) -> None:
        self.items = []
        self._pending_logprobs = []
        self.parser = None
