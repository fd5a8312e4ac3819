"""What the HTTP handlers share: config, store, hub, supervisor, auth."""

from __future__ import annotations

from dataclasses import dataclass

from service.api.auth import Authenticator
from service.config import Config
from service.engine import protocol as p
from service.errors import LmspdError
from service.hub import Hub
from service.models.registry import ModelRegistry
from service.responses.schema import ResponseRequest
from service.store.db import Database
from service.store.tasks import TaskStore
from service.supervisor import Supervisor


class ServerOverloadedError(LmspdError):
    code = "server_overloaded"


@dataclass
class AppState:
    config: Config
    db: Database
    store: TaskStore
    hub: Hub
    supervisor: Supervisor
    auth: Authenticator
    registry: ModelRegistry
    accepting: bool = True
    limits_enforced_at: float = 0.0

    def check_accepting(self) -> None:
        if not self.accepting:
            raise ServerOverloadedError("the server is shutting down")

    @staticmethod
    def sampling(request: ResponseRequest) -> p.SamplingParams:
        return p.SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
        )
