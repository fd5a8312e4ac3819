"""From a typed request to what the engine runs: ``prompt`` (items → chat template → tokens,
tool and reasoning markers), ``grammar`` (tool calls and text formats → llguidance grammars) and
``generation`` (the engine's ``Generate`` message, request checks against the model).

May import :mod:`lmspd.responses`, :mod:`lmspd.chat` and the rooms below; never ``core``,
``api`` or ``cli``."""
