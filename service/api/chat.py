"""``POST /v1/chat/completions``: a thin view on the same durable core as /v1/responses.

The chat request becomes a (not stored) response task; its result and event log are
rendered as a chat completion or chunks (``lmspd.chat.view``).
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lmspd.api.events import Cut, event_stream, openai_stream, while_connected
from lmspd.api.problems import openai_response
from lmspd.api.routing import AUTH, EVENTS_OPENAI, GENERATE, INTAKE, Op, Operation
from lmspd.api.state import state_of
from lmspd.api.wire import decode, read_body
from lmspd.chat.params import name_chat_fields
from lmspd.chat.schema import ChatCompletionRequest
from lmspd.chat.view import ChatCompletion, ChatCompletionChunk, ChatError, ChunkStream, completion
from lmspd.errors import LmspdError, error_for
from lmspd.responses import schema as s


async def create_chat_completion(request: Request) -> Response:
    app = state_of(request)
    owner = app.auth.owner(request)
    chat = decode(await read_body(request, app.config.server.max_body_bytes), ChatCompletionRequest)
    try:
        accepted, extras = chat.to_response_request()
        if extras.logprobs is not None:
            accepted = accepted.replace(include=[s.LOGPROBS], top_logprobs=extras.logprobs)
        task_request = accepted.task(stop=extras.stop or None, seed=extras.seed)
        task, _ = await app.core.intake.submit(owner, task_request, kind="response")
    except LmspdError as exc:  # checked as the Responses request it runs as: named as Chat's fields
        name_chat_fields(exc, chat)
        raise
    completion_id = f"chatcmpl-{task.response_id.removeprefix('resp_')}"
    if chat.stream:
        model = accepted.request.model or app.config.default_model
        chunks = ChunkStream(completion_id, model, task.created_at, include_usage=chat.include_usage)

        def end(cut: Cut) -> bytes:
            return chunks.cut(cut.code, cut.message)

        stream = openai_stream(app.core, task, -1, chunks.frames, end, own=True)
        return event_stream(request, stream)
    final = await while_connected(request, app.core.endings.outcome(task), task=task)
    response = msgspec.json.decode(await app.core.reads.snapshot(final), type=s.Response)
    await app.core.endings.release(final)
    if response.status == "failed":
        return openai_response(failed_error(response))
    body = completion(response, completion_id=completion_id, created=task.created_at)
    return Response(msgspec.json.encode(body), media_type="application/json")


def failed_error(response: s.Response) -> LmspdError:
    """A failed generation as the error its code stands for: a request the model could not
    take (its context, its grammar) is the client's 4xx, a crash or restart the server's 500."""
    err = response.error
    if err is None:
        return LmspdError(f"the response ended {response.status}")
    return error_for(err.code, err.message)


def route(prefix: str) -> Operation:
    return Operation(
        f"{prefix}/chat/completions",
        create_chat_completion,
        Op(
            "Chat Completions (not stored); `stream: true` streams chunks",
            "chat",
            ChatCompletion,
            request=ChatCompletionRequest,
            events=(ChatCompletionChunk, ChatError),
            errors=(*AUTH, *GENERATE, *INTAKE),
            description=EVENTS_OPENAI + " A generation that fails mid-stream sends an error object as its last data.",
        ),
        "POST",
    )
