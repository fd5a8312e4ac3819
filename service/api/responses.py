"""OpenAI Responses API (``/v1/responses``, ``/responses``, ``POST /lmsp/v1/responses``).

Translation only: every response is a durable task run by ``lmspd.core``. A
synchronous request waits on it, a streaming one streams its event log, a
background one is polled; a foreground client that goes away abandons its task.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lmspd import errors as e
from lmspd.api import wire
from lmspd.api.events import Cut, event_stream, openai_stream, resume_point, while_connected
from lmspd.api.routing import AUTH, EVENTS_OPENAI, GENERATE, INTAKE, LIMIT, Op, Operation, header, query
from lmspd.api.state import state_of
from lmspd.api.wire import (
    DeletedResponse,
    InputTokens,
    ascii_int,
    decode,
    fingerprint,
    idempotency_key,
    read_body,
)
from lmspd.responses import items as input_items_of
from lmspd.responses import schema as s
from lmspd.responses.checks import Accepted, accept
from lmspd.store.task_store import Event

T = TypeVar("T")
log = logging.getLogger("lmspd.responses")
# Names the hosted tool types ``[responses] hosted_tools = "omit"`` left out of a request.
OMITTED_TOOLS_HEADER = "lmspd-omitted-tools"


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _raw_json(data: bytes) -> Response:
    return Response(data, media_type="application/json")


async def _decode_request(request: Request) -> tuple[bytes, Accepted[s.ResponseRequest]]:
    config = state_of(request).config
    body = await read_body(request, config.server.max_body_bytes)
    accepted = accept(decode(body, s.ResponseRequest), hosted_tools=config.responses.hosted_tools)
    if omitted := list(accepted.omitted_tools):
        log.info("hosted tools left out: %s", ", ".join(omitted), extra={"omitted_tools": omitted})
    return body, accepted


def said_omitted(response: Response, omitted: Sequence[str]) -> Response:
    """The response says which hosted tools intake left out of the request (docs/responses.md,
    "Coding agents"; the Messages view's server tools too)."""
    if omitted:
        response.headers[OMITTED_TOOLS_HEADER] = ", ".join(omitted)
    return response


def _said(response: Response, accepted: Accepted[s.ResponseRequest]) -> Response:
    return said_omitted(response, accepted.omitted_tools)


async def create_response(request: Request) -> Response:
    app = state_of(request)
    owner = app.auth.owner(request)
    body, accepted = await _decode_request(request)
    req = accepted.request
    key = idempotency_key(request) if req.background else None
    task, _ = await app.core.intake.submit(
        owner, accepted, kind="response", idempotency=(key, fingerprint(body)) if key else None
    )
    if req.background:
        return _said(_raw_json(await app.core.reads.snapshot(task)), accepted)
    if req.compact_threshold() is not None:
        # Compaction ends before the stream opens or the answer is awaited: a refusal is a 400.
        await while_connected(request, app.core.endings.past_compaction(task), task=task)
    if req.stream:
        stream = openai_stream(app.core, task, -1, render, stream_error, own=True)
        return _said(event_stream(request, stream), accepted)
    final = await while_connected(request, app.core.endings.outcome(task), task=task)
    data = await app.core.reads.snapshot(final)
    await app.core.endings.release(final)
    return _said(_raw_json(data), accepted)


async def compact(request: Request) -> Response:
    """``POST /v1/responses/compact``: one compaction item for the history sent (nothing stored)."""
    app = state_of(request)
    owner = app.auth.owner(request)
    body = decode(await read_body(request, app.config.server.max_body_bytes), s.CompactRequest)
    body.validate()
    return _json(await while_connected(request, app.core.compaction.compact(owner, body)))


def openai_frame(ev: Event) -> bytes:
    """OpenAI's SSE framing. LMSP's ``response.cancelled`` is not an OpenAI event: /v1 clients
    get ``response.incomplete`` carrying the response with ``status: "cancelled"``."""
    if ev.type == "response.cancelled":
        cancelled = s.event_decoder.decode(ev.data)
        assert isinstance(cancelled, s.ResponseCancelled)
        final = s.ResponseIncomplete(sequence_number=cancelled.sequence_number, response=cancelled.response)
        return b"event: response.incomplete\ndata: %s\n\n" % s.encoder.encode(final)
    return b"event: %s\ndata: %s\n\n" % (ev.type.encode(), ev.data)


def render(batch: list[Event]) -> bytes:
    return b"".join(openai_frame(ev) for ev in batch)


def stream_error(cut: Cut) -> bytes:
    """The ``error`` event a stream the server ends early sends last (before ``[DONE]``)."""
    event = s.StreamError(sequence_number=cut.sequence_number, code=cut.code, message=cut.message)
    return b"event: error\ndata: %s\n\n" % s.encoder.encode(event)


async def get_response(request: Request) -> Response:
    app = state_of(request)
    task = await app.core.reads.response_task(request.path_params["response_id"], app.auth.owner(request))
    if request.query_params.get("stream") in ("true", "1"):
        after = resume_point(request.query_params.get("starting_after"), "starting_after", task.next_seq)
        stream = openai_stream(app.core, task, after, render, stream_error, own=False)
        return event_stream(request, stream)
    return _raw_json(await app.core.reads.snapshot(task))


async def delete_response(request: Request) -> Response:
    app = state_of(request)
    task = await app.core.reads.response_task(request.path_params["response_id"], app.auth.owner(request))
    await app.core.endings.delete(task)
    return _json(DeletedResponse(id=task.response_id, deleted=True))


async def cancel_response(request: Request) -> Response:
    app = state_of(request)
    owner = app.auth.owner(request)
    task = await app.core.reads.response_task(request.path_params["response_id"], owner)
    if task.status not in ("succeeded", "failed"):
        task = await app.core.endings.cancel_and_wait(task.id, owner)
    return _raw_json(await app.core.reads.snapshot(task))


async def input_tokens(request: Request) -> Response:
    app = state_of(request)
    owner = app.auth.owner(request)
    _, accepted = await _decode_request(request)
    count = await app.core.intake.input_tokens(owner, accepted)
    return _said(_json(InputTokens(input_tokens=count)), accepted)


async def list_input_items(request: Request) -> Response:
    app = state_of(request)
    task = await app.core.reads.response_task(request.path_params["response_id"], app.auth.owner(request))
    query = request.query_params
    page = input_items_of.page(
        input_items_of.resources(task.response_id, await app.core.reads.input_items(task)),
        limit=ascii_int(query.get("limit", "20"), "limit", 1, 100),
        order=query.get("order", "desc"),
        after=query.get("after"),
        include=query.getlist("include"),
    )
    return _json(page)


_CREATE = Op(
    "Create a response: synchronous, streamed (`stream: true`) or in the background",
    "responses",
    s.Response,
    request=s.ResponseRequest,
    events=(s.ResponseEvent, s.StreamError),
    errors=(*AUTH, *GENERATE, e.IdempotencyKeyReusedError, e.TooManyBackgroundJobsError, *INTAKE),
    params=(header("Idempotency-Key", "background requests only: a retry with it replays the response"),),
    description=EVENTS_OPENAI,
)
_COMPACT = Op(
    "Compact a history into one compaction item (stores nothing)",
    "responses",
    s.CompactResponse,
    request=s.CompactRequest,
    errors=(*AUTH, *GENERATE, *INTAKE),
)


def routes(prefix: str) -> list[Operation]:
    """The Responses API under ``prefix`` ("/v1", or "" for clients that leave it out)."""
    return [
        Operation(f"{prefix}/responses", create_response, _CREATE, "POST"),
        Operation(
            f"{prefix}/responses/input_tokens",
            input_tokens,
            Op(
                "Count a request's input tokens, history included",
                "responses",
                wire.InputTokens,
                request=s.ResponseRequest,
                errors=(*AUTH, *GENERATE),
            ),
            "POST",
        ),
        Operation(f"{prefix}/responses/compact", compact, _COMPACT, "POST"),
        Operation(
            f"{prefix}/responses/{{response_id}}",
            get_response,
            Op(
                "A stored response; `?stream=true` replays and follows its events",
                "responses",
                s.Response,
                events=(s.ResponseEvent, s.StreamError),
                errors=(*AUTH, e.InvalidRequestError, e.NotFoundError),
                params=(
                    query("stream", {"type": "boolean"}, "stream the response's events"),
                    query(
                        "starting_after", {"type": "integer", "minimum": -1}, "with stream: after this sequence number"
                    ),
                ),
                description=EVENTS_OPENAI,
            ),
        ),
        Operation(
            f"{prefix}/responses/{{response_id}}",
            delete_response,
            Op(
                "Delete a stored response (an unfinished background one: cancel first)",
                "responses",
                wire.DeletedResponse,
                errors=(*AUTH, e.InvalidRequestError, e.NotFoundError),
            ),
            "DELETE",
        ),
        Operation(
            f"{prefix}/responses/{{response_id}}/cancel",
            cancel_response,
            Op(
                "Cancel a response (idempotent; a finished one comes back unchanged)",
                "responses",
                s.Response,
                errors=(*AUTH, e.NotFoundError),
            ),
            "POST",
        ),
        Operation(
            f"{prefix}/responses/{{response_id}}/input_items",
            list_input_items,
            Op(
                "A response's input items",
                "responses",
                input_items_of.InputItemList,
                errors=(*AUTH, e.InvalidRequestError, e.NotFoundError),
                params=(
                    LIMIT,
                    query("order", {"enum": ["asc", "desc"], "default": "desc"}, "by position in the input"),
                    query("after", {"type": "string"}, "the last item id of the previous page"),
                    query(
                        "include",
                        {"type": "array", "items": {"enum": sorted(input_items_of.INCLUDABLE)}},
                        "accepted, changes nothing",
                    ),
                ),
            ),
        ),
    ]


LMSP_ROUTES = [  # the same operations, errors as problem objects
    Operation("/lmsp/v1/responses", create_response, _CREATE, "POST"),
    Operation("/lmsp/v1/responses/compact", compact, _COMPACT, "POST"),
]
