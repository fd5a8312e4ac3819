"""The service layer: :class:`Core` (``service``), the operations every HTTP surface exposes, by
concern: ``intake``, ``reads``, ``endings``, ``model_ops``, ``compact`` and ``summary``, one small
object each, composed once; the ``supervisor`` that owns the engine process and turns its output
into durable events (each run's steps in order, its ``claim`` in one place); ``transitions``,
every write that moves a task and the settling of interrupted ones by policy; the ``hub`` that
wakes subscribers; ``storage_backoff``; the ``compactor``; and ``runtime``, the composition root
that builds all of them for an app.

May import ``prompting`` and every room below it; never ``api`` or ``cli``."""

from lmspd.core.service import Core

__all__ = ["Core"]
