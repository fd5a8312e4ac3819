"""Chat Completions: a thin compatibility view on the Responses core (docs/responses.md).

:mod:`lmspd.chat.schema` turns a ``POST /v1/chat/completions`` body into the
:class:`~lmspd.responses.schema.ResponseRequest` the core runs;
:mod:`lmspd.chat.view` turns the resulting response (or its event log) back
into ``chat.completion`` objects and ``chat.completion.chunk`` SSE frames;
:mod:`lmspd.chat.params` names a refused request's field as Chat has it (``messages``,
not ``input``).
Nothing here touches HTTP or the database.
"""
