"""The Anthropic Messages API: a third view on the Responses core (docs/messages.md).

:mod:`lmspd.messages.schema` decodes a ``POST /v1/messages`` (or ``/count_tokens``) body, one
``msgspec.Struct`` per wire object, and translates it into the
:class:`~lmspd.responses.schema.TaskRequest` the core runs (remembering where each input item
and tool came from); :mod:`lmspd.messages.params` names a refused request's field as the
Messages request has it (``messages[2].content[1].signature``, not ``input[3].encrypted_content``)
and says a prompt too long in the form Messages clients parse; :mod:`lmspd.messages.view` turns
the finished response, or its event log, into a ``message`` object or Messages stream events.
Nothing here touches HTTP or the database.
"""
