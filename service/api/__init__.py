"""HTTP only: the Starlette app (``app.create_app``, the route table), one module per surface
(``tasks``: LMSP tasks, ``responses``: the Responses API, ``chat``: Chat Completions,
``events``: server-sent events), the wire Structs, problem and OpenAI error bodies, auth and the
access log. ``openapi`` renders the document from the Structs.

Handlers translate HTTP into calls of the parts of :class:`lmspd.core.Core` (intake, reads,
endings, models, compaction, status) and back; they hold no
behaviour of their own. May import :mod:`lmspd.core` and the rooms below it, never ``cli``."""
