"""What the HTTP handlers share: the core, the authenticator and the config."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from service.api.auth import Authenticator
from service.config import Config
from service.core import Core


@dataclass
class AppState:
    config: Config
    core: Core
    auth: Authenticator


def state_of(request: Request) -> AppState:
    app_state: AppState = request.app.state.lmsp
    return app_state
