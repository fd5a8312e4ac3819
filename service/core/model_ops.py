"""The operator's model operations: list, load, unload, pin (lmspd.core.lifecycle) and the
engine's recycle (lmspd.core.recycle), as ``/lmsp/v1/models`` and ``/v1/models`` call them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from lmspd.core.lifecycle import ModelView
from lmspd.core.supervisor import Supervisor
from lmspd.models.registry import ModelInfo, ModelRegistry
from lmspd.store.task_store import TaskRecord


class ModelOps:
    """``cancel``: cancels a task (an unload with ``force`` cancels the tasks running on it)."""

    def __init__(
        self, registry: ModelRegistry, supervisor: Supervisor, cancel: Callable[[str], Awaitable[TaskRecord]]
    ) -> None:
        self.registry = registry
        self.supervisor = supervisor
        self.cancel = cancel

    def models(self) -> list[ModelInfo]:
        return self.registry.list()

    async def views(self) -> list[ModelView]:
        return await self.supervisor.lifecycle.views()

    async def load(self, name: str) -> ModelView:
        return await self.supervisor.lifecycle.load(name, self.supervisor.slots)

    async def unload(self, name: str, *, force: bool) -> ModelView:
        """Refused (409, nothing changed) while tasks run on it, unless ``force`` cancels them."""
        lifecycle, slots = self.supervisor.lifecycle, self.supervisor.slots
        return await lifecycle.unload(name, slots, force=force, cancel=self.cancel)

    async def pin(self, name: str, pinned: bool) -> ModelView:
        return await self.supervisor.lifecycle.pin(name, pinned)

    def recycle_engine(self) -> bool:
        """An operator's engine recycle (lmspd.core.recycle); False: one is under way already."""
        return self.supervisor.recycle("operator")
