"""Turn a generation's progress into Responses streaming events (SPEC 6.3).

The state of a response in progress (its message item, text so far, generated
token ids) is derived from its event log, so after a restart a ``resume`` task
rebuilds it with :meth:`ResponseState.from_events` and carries on where it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec
import ulid

from service.responses import schema as s
from service.store.tasks import Event, EventBuilder, NewEvent, TaskRecord

EventFactory = Callable[[int], s._Event]


def to_builder(factory: EventFactory, tokens: list[int] | None = None) -> EventBuilder:
    def build(task: TaskRecord, seq: int) -> NewEvent:
        event = factory(seq)
        return NewEvent(str(type(event).__struct_config__.tag), s.encoder.encode(event), tokens)

    return build


def initial_response(
    request: s.ResponseRequest, *, response_id: str, model: str, created_at: int, background: bool = True
) -> s.Response:
    return s.Response(
        background=background,
        store=request.store,
        previous_response_id=request.previous_response_id,
        parallel_tool_calls=True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        tool_choice=request.tool_choice if isinstance(request.tool_choice, str) else "auto",
        safety_identifier=request.safety_identifier,
        prompt_cache_key=request.prompt_cache_key,
        id=response_id,
        created_at=created_at,
        # A background response waits in the queue; a foreground one is under way for its client.
        status="queued" if background else "in_progress",
        model=model,
        instructions=request.instructions,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        max_output_tokens=request.max_output_tokens,
        max_tool_calls=request.max_tool_calls,
        top_logprobs=request.top_logprobs or 0,
        metadata=request.metadata or {},
    )


class ResponseState:
    def __init__(self, response: s.Response) -> None:
        self.response = response
        self.item_id: str | None = None
        self.text = ""
        self.tokens: list[int] = []
        self.logprobs: list[s.LogProb] = []

    @classmethod
    def from_events(cls, events: Sequence[Event]) -> ResponseState:
        """Rebuild from a task's event log (the first event is ``response.created``).

        Only an unfinished task's log is complete: the janitor purges finished ones, whose
        final response is kept with the task instead."""
        if not events:
            raise ValueError("an event log starts with response.created; this one is empty")
        first = s.event_decoder.decode(events[0].data)
        assert isinstance(first, s.ResponseCreated)
        state = cls(first.response)
        for row in events[1:]:
            ev = s.event_decoder.decode(row.data)
            if isinstance(
                ev,
                s.ResponseInProgress
                | s.ResponseCompleted
                | s.ResponseIncomplete
                | s.ResponseFailed
                | s.ResponseCancelled,
            ):
                state.response = ev.response
            elif isinstance(ev, s.OutputItemAdded):
                state.item_id = ev.item.id
            elif isinstance(ev, s.OutputTextDelta):
                state.text += ev.delta
                state.logprobs += ev.logprobs
            elif isinstance(ev, s.AttemptRestarted):
                state.item_id, state.text, state.tokens, state.logprobs = None, "", [], []
            if row.tokens:
                state.tokens.extend(row.tokens)
        return state

    def _snapshot(self, **changes: object) -> s.Response:
        self.response = msgspec.structs.replace(self.response, **changes)
        return self.response

    def _message(self, status: str) -> s.OutputMessage:
        assert self.item_id is not None
        content = [self._part()] if status != "in_progress" else []
        return s.OutputMessage(id=self.item_id, status=status, content=content)  # type: ignore[arg-type]

    def _part(self) -> s.OutputText:
        return s.OutputText(self.text, logprobs=list(self.logprobs))

    def created(self) -> list[EventBuilder]:
        return [to_builder(lambda seq: s.ResponseCreated(sequence_number=seq, response=self.response))]

    def queued(self) -> EventBuilder:
        """The response waits for a generation slot (Open Responses ``response.queued``)."""
        response = msgspec.structs.replace(self.response, status="queued")
        return to_builder(lambda seq: s.ResponseQueued(sequence_number=seq, response=response))

    def in_progress(self) -> list[EventBuilder]:
        response = self._snapshot(status="in_progress")
        return [to_builder(lambda seq: s.ResponseInProgress(sequence_number=seq, response=response))]

    def delta(self, text: str, tokens: list[int], logprobs: list[s.LogProb] | None = None) -> list[EventBuilder]:
        out: list[EventBuilder] = []
        if self.item_id is None:
            self.item_id = f"msg_{ulid.new()}"
            item = self._message("in_progress")
            out.append(to_builder(lambda seq: s.OutputItemAdded(sequence_number=seq, output_index=0, item=item)))
            out.append(
                to_builder(
                    lambda seq: s.ContentPartAdded(
                        sequence_number=seq, item_id=item.id, output_index=0, content_index=0, part=s.OutputText("")
                    )
                )
            )
        item_id = self.item_id
        self.text += text
        self.tokens.extend(tokens)
        new_logprobs = logprobs or []
        self.logprobs += new_logprobs
        out.append(
            to_builder(
                lambda seq: s.OutputTextDelta(
                    sequence_number=seq,
                    item_id=item_id,
                    output_index=0,
                    content_index=0,
                    delta=text,
                    logprobs=new_logprobs,
                ),
                tokens,
            )
        )
        return out

    def finish(self, reason: str, prompt_tokens: int) -> list[EventBuilder]:
        """The closing events; ``reason`` is the engine's ("stop" or "length")."""
        out = self.delta("", []) if self.item_id is None else []
        complete = reason == "stop"
        output, done = self._close_item("completed" if complete else "incomplete")
        usage = s.Usage(
            input_tokens=prompt_tokens, output_tokens=len(self.tokens), total_tokens=prompt_tokens + len(self.tokens)
        )
        response = self._snapshot(
            status="completed" if complete else "incomplete",
            completed_at=int(time.time()) if complete else None,
            incomplete_details=None if complete else s.IncompleteDetails("max_output_tokens"),
            output=output,
            usage=usage,
        )
        final = s.ResponseCompleted if complete else s.ResponseIncomplete
        return [*out, *done, to_builder(lambda seq: final(sequence_number=seq, response=response))]

    def _close_item(self, status: str = "incomplete") -> tuple[list[s.OutputMessage], list[EventBuilder]]:
        """Close the open message item, if any. A stream that ends early (failed,
        cancelled) still gets its ``.done`` events, as clients' accumulators expect."""
        if self.item_id is None:
            return [], []
        item_id = self.item_id
        item = self._message(status)
        part = self._part()
        events = [
            to_builder(
                lambda seq: s.OutputTextDone(
                    sequence_number=seq,
                    item_id=item_id,
                    output_index=0,
                    content_index=0,
                    text=part.text,
                    logprobs=part.logprobs,
                )
            ),
            to_builder(
                lambda seq: s.ContentPartDone(
                    sequence_number=seq, item_id=item_id, output_index=0, content_index=0, part=part
                )
            ),
            to_builder(lambda seq: s.OutputItemDone(sequence_number=seq, output_index=0, item=item)),
        ]
        return [item], events

    def failed(self, code: str, message: str) -> list[EventBuilder]:
        output, events = self._close_item()
        response = self._snapshot(status="failed", error=s.ResponseError(code, message), output=output)
        return [*events, to_builder(lambda seq: s.ResponseFailed(sequence_number=seq, response=response))]

    def cancelled(self) -> list[EventBuilder]:
        output, events = self._close_item()
        response = self._snapshot(status="cancelled", output=output)
        return [*events, to_builder(lambda seq: s.ResponseCancelled(sequence_number=seq, response=response))]

    def encoded(self) -> bytes:
        """The response object as it stands (the final one once a closing method ran)."""
        return s.encoder.encode(self.response)

    def restarted(self, attempt: int, reason: str) -> list[EventBuilder]:
        """A ``retry`` starts over: clients discard what they accumulated."""
        self.item_id, self.text, self.tokens, self.logprobs = None, "", [], []
        self._snapshot(status="queued", output=[], usage=None)
        return [to_builder(lambda seq: s.AttemptRestarted(sequence_number=seq, attempt=attempt, reason=reason))]
