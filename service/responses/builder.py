"""Turn a generation's progress into Responses streaming events (docs/lmsp.md §6.3).

The state of a response in progress (its output items so far, generated token ids)
is derived from its event log, so after a restart a ``resume`` task rebuilds it
with :meth:`ResponseState.from_events` and carries on where it was.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from lmspd.responses import schema as s
from lmspd.responses.outputs import EventFactory, OutputItems, Status
from lmspd.responses.tools import (
    CustomTool,
    Directives,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedCustom,
    NamedFunction,
    ReasoningParam,
    TextParam,
)
from lmspd.store.task_store import Event, EventBuilder, NewEvent, TaskRecord


def to_builder(factory: EventFactory, tokens: list[int] | None = None) -> EventBuilder:
    def build(task: TaskRecord, seq: int) -> NewEvent:
        event = factory(seq)
        return NewEvent(str(type(event).__struct_config__.tag), s.encoder.encode(event), tokens)

    return build


def _echoed_text(param: TextParam) -> s.TextField:
    fmt, verbosity = param.format, param.verbosity
    if isinstance(fmt, JsonSchemaFormat):
        echoed = s.EchoedJsonSchema(name=fmt.name, description=fmt.description, strict=bool(fmt.strict))
        return s.TextField(format=echoed, verbosity=verbosity)
    if isinstance(fmt, JsonObjectFormat):
        return s.TextField(format=fmt, verbosity=verbosity)
    return s.TextField(verbosity=verbosity)


def _echoed_reasoning(param: ReasoningParam | None) -> s.ReasoningConfig | None:
    return None if param is None else s.ReasoningConfig(param.effort, param.summary or param.generate_summary)


def initial_response(
    request: s.ResponseRequest,
    *,
    response_id: str,
    model: str,
    created_at: int,
    background: bool = True,
    parsed: Directives | None = None,
) -> s.Response:
    """``parsed``: the request's directives as intake carries them (None: parsed from it here)."""
    parsed = parsed or s.directives_of(request)
    options = parsed.tools
    sampling = request.sampling()
    choice: str | NamedFunction | NamedCustom = options.choice
    if options.choice not in ("none", "auto", "required"):
        (named,) = options.callable
        name, _ = options.origin(named.name)
        choice = NamedCustom(name=name) if isinstance(named, CustomTool) else NamedFunction(name=name)
    return s.Response(
        background=background,
        store=request.store,
        previous_response_id=request.previous_response_id,
        parallel_tool_calls=options.parallel,
        tools=options.declared,
        tool_choice=choice,
        text=_echoed_text(parsed.text),
        reasoning=_echoed_reasoning(parsed.reasoning),
        safety_identifier=request.safety_identifier,
        prompt_cache_key=request.prompt_cache_key,
        id=response_id,
        created_at=created_at,
        # A background response waits in the queue; a foreground one is under way for its client.
        status="queued" if background else "in_progress",
        model=model,
        instructions=request.instructions,
        # What it samples with: the request's values, else the model's defaults it was accepted with.
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_output_tokens=request.max_output_tokens,
        max_tool_calls=request.max_tool_calls,
        top_logprobs=request.top_logprobs or 0,
        metadata=request.metadata or {},
    )


class ResponseState:
    def __init__(self, response: s.Response) -> None:
        self.response = response
        self.outputs = OutputItems()
        self.tokens: list[int] = []
        # Generated tokens whose text produced no event yet (the parser holds it back):
        # they are stored with the next event. Lost in a crash, they are generated again.
        self._unsaved: list[int] = []
        # Input tokens when this attempt's compaction started (its event is in the log).
        self.compaction_started: int | None = None
        self.reasoning_tokens = 0  # of ``tokens``, those that were reasoning

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
        pending = 0  # tokens of a batch whose kind is not known yet (see _events)
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
            elif isinstance(ev, s.AttemptRestarted):
                state.outputs.reset()
                state.tokens = []
                state.compaction_started = None
                state.reasoning_tokens, pending = 0, 0
            elif isinstance(ev, s.CompactionStarted):
                state.compaction_started = ev.input_tokens
            else:
                state.outputs.replay(ev)
            if row.tokens:
                state.tokens.extend(row.tokens)
                pending = len(row.tokens)  # the batch they came with starts here
            if pending and not _closing(ev):
                state.reasoning_tokens += pending if _reasoning(ev) else 0
                pending = 0
        return state

    def _snapshot(self, **changes: object) -> s.Response:
        self.response = msgspec.structs.replace(self.response, **changes)
        return self.response

    def _events(self, factories: list[EventFactory]) -> list[EventBuilder]:
        """Builders for ``factories``; the first carries the tokens not stored yet. They are
        reasoning tokens when the batch's first event that closes nothing is reasoning's: a rule
        the event log alone can apply again (:meth:`from_events`)."""
        if not factories:
            return []
        tokens, self._unsaved = self._unsaved, []
        if tokens:
            kinds = (factory(0) for factory in factories)  # pure: built again at commit
            first = next((ev for ev in kinds if not _closing(ev)), None)
            self.reasoning_tokens += len(tokens) if first is not None and _reasoning(first) else 0
        return [to_builder(f, tokens if i == 0 and tokens else None) for i, f in enumerate(factories)]

    def created(self) -> list[EventBuilder]:
        return [to_builder(lambda seq: s.ResponseCreated(sequence_number=seq, response=self.response))]

    def queued(self) -> EventBuilder:
        """The response waits for a generation slot (Open Responses ``response.queued``)."""
        response = msgspec.structs.replace(self.response, status="queued")
        return to_builder(lambda seq: s.ResponseQueued(sequence_number=seq, response=response))

    def in_progress(self) -> list[EventBuilder]:
        response = self._snapshot(status="in_progress")
        return [to_builder(lambda seq: s.ResponseInProgress(sequence_number=seq, response=response))]

    def compaction_begins(self, input_tokens: int) -> list[EventBuilder]:
        self.compaction_started = input_tokens
        response_id = self.response.id
        return self._events(
            [lambda seq: s.CompactionStarted(sequence_number=seq, response_id=response_id, input_tokens=input_tokens)]
        )

    def compaction_done(self, item_id: str, encrypted_content: str, before: int, after: int) -> list[EventBuilder]:
        """``mlx.compaction.completed`` and the compaction item, committed together."""
        response_id = self.response.id
        completed: EventFactory = lambda seq: s.CompactionCompleted(  # noqa: E731
            sequence_number=seq, response_id=response_id, input_tokens_before=before, input_tokens_after=after
        )
        return self._events([completed, *self.outputs.add_compaction(item_id, encrypted_content)])

    def delta(self, text: str, tokens: list[int], logprobs: list[s.LogProb] | None = None) -> list[EventBuilder]:
        self.tokens.extend(tokens)
        self._unsaved.extend(tokens)
        return self._events(self.outputs.feed(text, logprobs or []))

    def finish(
        self, reason: str, prompt_tokens: int, cached_tokens: int = 0, stop_sequence: str | None = None
    ) -> list[EventBuilder]:
        """The closing events; ``reason`` is the engine's ("stop" or "length"); ``cached_tokens``
        of the prompt came from the prompt cache; ``stop_sequence`` the stop string that ended
        it, if one did."""
        complete = reason == "stop"
        status: Status = "completed" if complete else "incomplete"
        factories = self.outputs.finish()
        factories += self.outputs.close(status)
        if not self.outputs.answered:  # an empty answer is still a message
            factories += self.outputs.open_message() + self.outputs.close(status)
        usage = s.Usage(
            input_tokens=prompt_tokens,
            output_tokens=len(self.tokens),
            total_tokens=prompt_tokens + len(self.tokens),
            input_tokens_details=s.InputTokensDetails(cached_tokens),
            output_tokens_details=s.OutputTokensDetails(self.reasoning_tokens),
        )
        response = self._snapshot(
            status=status,
            completed_at=int(time.time()) if complete else None,
            incomplete_details=None if complete else s.IncompleteDetails("max_output_tokens"),
            output=self.outputs.output(),
            usage=usage,
            stop_sequence=msgspec.UNSET if stop_sequence is None else stop_sequence,
        )
        final = s.ResponseCompleted if complete else s.ResponseIncomplete
        return self._events([*factories, lambda seq: final(sequence_number=seq, response=response)])

    def failed(self, code: str, message: str) -> list[EventBuilder]:
        factories = self.outputs.close("incomplete")
        response = self._snapshot(status="failed", error=s.ResponseError(code, message), output=self.outputs.output())
        return self._events([*factories, lambda seq: s.ResponseFailed(sequence_number=seq, response=response)])

    def cancelled(self) -> list[EventBuilder]:
        factories = self.outputs.close("incomplete")
        response = self._snapshot(status="cancelled", output=self.outputs.output())
        return self._events([*factories, lambda seq: s.ResponseCancelled(sequence_number=seq, response=response)])

    def encoded(self) -> bytes:
        """The response object as it stands (the final one once a closing method ran)."""
        return s.encoder.encode(self.response)

    def restarted(self, attempt: int, reason: str) -> list[EventBuilder]:
        """A ``retry`` starts over: clients discard what they accumulated."""
        self.outputs.reset()
        self.tokens, self._unsaved = [], []
        self.compaction_started = None
        self.reasoning_tokens = 0
        self._snapshot(status="queued", output=[], usage=None)
        return [to_builder(lambda seq: s.AttemptRestarted(sequence_number=seq, attempt=attempt, reason=reason))]


_CLOSING = (
    s.OutputItemDone,
    s.OutputTextDone,
    s.ContentPartDone,
    s.ReasoningTextDone,
    s.FunctionCallArgumentsDone,
    s.CustomToolCallInputDone,
)


def _closing(event: s._Event) -> bool:
    """An event that ends the item before (a batch's first event may close the last item)."""
    return isinstance(event, _CLOSING)


def _reasoning(event: s._Event) -> bool:
    if isinstance(event, s.ReasoningTextDelta):
        return True
    return isinstance(event, s.OutputItemAdded) and isinstance(event.item, s.Reasoning)
