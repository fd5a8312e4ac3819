"""What the HTTP handlers share: the core, the authenticator and the config."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from lmspd.api.auth import Authenticator
from lmspd.config import Config
from lmspd.core import Core


@dataclass
class AppState:
    config: Config
    core: Core
    auth: Authenticator


def state_of(request: Request) -> AppState:
    app_state: AppState = request.app.state.lmsp
    return app_state
