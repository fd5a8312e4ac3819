"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: the Anthropic Messages API, a thin
view on the same durable core as /v1/responses (docs/messages.md).

The Messages request becomes a (not stored) response task, as a chat request does; its result
and event log are rendered as a ``message`` or Messages stream events (``lmspd.messages.view``).
Claude Code's ``?beta=true`` and the ``anthropic-version`` / ``anthropic-beta`` headers change
nothing. Errors are in Anthropic's envelope (lmspd.api.problems).
"""

from __future__ import annotations

import logging
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lmspd import errors as e
from lmspd.api.chat import failed_error
from lmspd.api.events import Cut, event_stream, openai_stream, while_connected
from lmspd.api.responses import said_omitted
from lmspd.api.routing import AUTH, GENERATE, INTAKE, Op, Operation, header, query
from lmspd.api.state import AppState, state_of
from lmspd.api.wire import decode, read_body
from lmspd.messages import view
from lmspd.messages.params import name_messages_fields, translate
from lmspd.messages.schema import CountTokensRequest, MessagesBody, MessagesRequest, Translation
from lmspd.responses import schema as s
from lmspd.responses.checks import Accepted
from lmspd.responses.schema import TaskRequest

B = TypeVar("B", bound=MessagesBody)
log = logging.getLogger("lmspd.messages")
# Claude Code's timeouts: a long prompt's prefill is answered with a ping at least this often.
PING_SECS = 5.0


async def _translated(request: Request, app: AppState, kind: type[B]) -> tuple[B, Translation, Accepted[TaskRequest]]:
    """The body decoded, translated and accepted; a refusal names the Messages field."""
    try:
        body = decode(await read_body(request, app.config.server.max_body_bytes), kind)
    except e.LmspdError as exc:
        name_messages_fields(exc, None)
        raise
    translation, accepted = translate(body, app.config.responses.hosted_tools)
    if translation.omitted:
        log.info(
            "server tools left out: %s", ", ".join(translation.omitted), extra={"omitted_tools": translation.omitted}
        )
    return body, translation, accepted


def _said(response: Response, translation: Translation) -> Response:
    return said_omitted(response, translation.omitted)


async def create_message(request: Request) -> Response:
    app = state_of(request)
    owner = app.auth.owner(request)
    body, translation, accepted = await _translated(request, app, MessagesRequest)
    try:
        task, _ = await app.core.intake.submit(owner, accepted, kind="response")
    except e.LmspdError as exc:  # checked as the Responses request it runs as: named as Messages' fields
        name_messages_fields(exc, translation)
        raise
    shape = view.Shape(
        message_id=view.message_id(task.response_id),
        model=body.model or app.config.default_model,
        max_tokens=translation.max_tokens,
        display_omitted=translation.display_omitted,
    )
    if body.stream:
        events = view.MessageStream(shape)

        def end(cut: Cut) -> bytes:
            return events.cut(cut.code, cut.message)

        keepalive = min(PING_SECS, app.config.server.keepalive_secs)
        stream = openai_stream(
            app.core, task, -1, events.frames, end, own=True, idle=view.ping(), trailer=b"", keepalive=keepalive
        )
        return _said(event_stream(request, stream), translation)
    final = await while_connected(request, app.core.endings.outcome(task), task=task)
    response = msgspec.json.decode(await app.core.reads.snapshot(final), type=s.Response)
    await app.core.endings.release(final)
    if response.status == "failed":
        raise failed_error(response)
    body_out = view.message(response, shape)
    return _said(Response(msgspec.json.encode(body_out), media_type="application/json"), translation)


async def count_tokens(request: Request) -> Response:
    app = state_of(request)
    owner = app.auth.owner(request)
    _, translation, accepted = await _translated(request, app, CountTokensRequest)
    try:
        count = await app.core.intake.input_tokens(owner, accepted)
    except e.LmspdError as exc:
        name_messages_fields(exc, translation)
        raise
    return _said(
        Response(msgspec.json.encode(view.TokenCount(input_tokens=count)), media_type="application/json"), translation
    )


EVENTS = (
    "Anthropic's server-sent events: per event `event: <type>` and `data: <JSON>` (described here): "
    "`message_start`, `content_block_start` / `content_block_delta` / `content_block_stop`, `message_delta`, "
    "`message_stop`; `ping` while nothing happens; `error` for a failure after the stream opened."
)
_PARAMS = (
    query("beta", {"type": "boolean"}, "Claude Code's `?beta=true`: accepted, changes nothing"),
    header("x-api-key", "the token, as Anthropic's clients send it (or `Authorization: Bearer`)"),
    header("anthropic-version", "accepted, changes nothing"),
    header("anthropic-beta", "accepted, changes nothing"),
)


def routes(prefix: str) -> list[Operation]:
    """The Messages API under ``prefix`` ("/v1", or "" for clients that leave it out)."""
    return [
        Operation(
            f"{prefix}/messages",
            create_message,
            Op(
                "Create a message (not stored); `stream: true` streams Messages events",
                "messages",
                view.MessageObject,
                request=MessagesRequest,
                events=(view.StreamEvent,),
                errors=(*AUTH, *GENERATE, *INTAKE),
                params=_PARAMS,
                description=EVENTS,
            ),
            "POST",
        ),
        Operation(
            f"{prefix}/messages/count_tokens",
            count_tokens,
            Op(
                "Count a Messages request's input tokens (system and tools included)",
                "messages",
                view.TokenCount,
                request=CountTokensRequest,
                errors=(*AUTH, *GENERATE),
                params=_PARAMS,
            ),
            "POST",
        ),
    ]
