"""The service layer: :class:`Core` (``operations``), one implementation of every operation the
HTTP surfaces expose; the ``supervisor`` that owns the engine process and turns its output into
durable events; the ``hub`` that wakes subscribers; ``storage_backoff``; the ``compactor``; and
``runtime``, the composition root that builds all of them for an app.

May import ``prompting`` and every room below it; never ``api`` or ``cli``."""

from lmspd.core.operations import Core

__all__ = ["Core"]
