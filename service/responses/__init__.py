"""The Responses API's objects, pure of I/O: the request Structs (``schema``, ``tools``), input
items (``inputs``, ``items``), output items and their streaming events (``outputs``,
``builder``), history, compaction rules and the reasoning echo; ``parsing/`` turns the model's
text into messages, reasoning and tool calls.

May import :mod:`lmspd.engine.protocol` (sampling parameters), :mod:`lmspd.models`,
:mod:`lmspd.store` and the ground floor; never ``chat``, ``prompting`` or anything above."""
