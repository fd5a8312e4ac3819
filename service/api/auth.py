"""Bearer tokens (docs/lmsp.md §9.1): constant-time comparison, one owner name per token.

A token comes in ``Authorization: Bearer``, or in ``x-api-key`` where there is none: Anthropic's
clients send it there (docs/messages.md), and it is the same token, with the same owner.

Operators' tokens (``[server] admin_tokens``) work everywhere an ordinary token does, and
they alone may call the model-control routes (load, unload, pin).
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from lmspd.errors import ForbiddenError, UnauthorizedError


class Authenticator:
    def __init__(self, tokens: dict[str, str], admin_tokens: dict[str, str] | None = None) -> None:
        admins = admin_tokens or {}
        self._tokens = [(name, token.encode(), False) for name, token in tokens.items()]
        self._tokens += [(name, token.encode(), True) for name, token in admins.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def _match(self, request: Request) -> tuple[str, bool]:
        header = request.headers.get("authorization")
        if header is None and (key := request.headers.get("x-api-key")):
            scheme, presented = "bearer", key
        else:
            scheme, _, presented = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise UnauthorizedError("missing token: send Authorization: Bearer <token> (or x-api-key: <token>)")
        candidate = presented.strip().encode()
        found: tuple[str, bool] | None = None
        for name, token, admin in self._tokens:  # compare against all, so timing does not tell which matched
            if hmac.compare_digest(candidate, token):
                found = (name, admin)
        if found is None:
            raise UnauthorizedError("invalid token")
        return found

    def owner(self, request: Request) -> str:
        """The token's name; '' when auth is off (loopback only)."""
        if not self._tokens:
            return ""
        return self._match(request)[0]

    def operator(self, request: Request) -> str:
        """The operator's token name ('' when auth is off: loopback only, anyone local may);
        ForbiddenError for an ordinary token."""
        if not self._tokens:
            return ""
        name, admin = self._match(request)
        if not admin:
            raise ForbiddenError("this call needs an operator token (server.admin_tokens)")
        return name
