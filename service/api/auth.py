"""Bearer tokens (docs/lmsp.md §9.1): constant-time comparison, one owner name per token."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from lmspd.errors import UnauthorizedError


class Authenticator:
    def __init__(self, tokens: dict[str, str]) -> None:
        self._tokens = [(name, token.encode()) for name, token in tokens.items()]

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def owner(self, request: Request) -> str:
        """The token's name; '' when auth is off (loopback only)."""
        if not self._tokens:
            return ""
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise UnauthorizedError("missing bearer token")
        candidate = presented.strip().encode()
        owner = None
        for name, token in self._tokens:  # compare against all, so timing does not tell which matched
            if hmac.compare_digest(candidate, token):
                owner = name
        if owner is None:
            raise UnauthorizedError("invalid bearer token")
        return owner
