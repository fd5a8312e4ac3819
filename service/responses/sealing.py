"""Sealed reasoning: the ``encrypted_content`` of reasoning items (docs/responses.md, "Coding agents").

A client that keeps no state on the server (Codex sends ``store: false`` and replays its whole
history every turn, with ``include: ["reasoning.encrypted_content"]``) gets each reasoning
item's text and id sealed into ``encrypted_content``, and sends the item back with only that.
Opened again, the reasoning renders exactly as it was generated, so the prompt cache keeps
matching the history.

The seal is AES-256-GCM with a key kept in the data directory (made on first use, mode 0600;
on PostgreSQL, in the database, so every node opens what any node sealed: store/secrets.py):
authenticated, so a client cannot pass its own text off as the model's reasoning; bound to the
owner (as associated data), so one token's holder cannot replay another's; and unreadable
without this server's key.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lmspd.errors import InvalidRequestError
from lmspd.store.files import private_dir

KEY_FILE = "reasoning.key"
PREFIX = "lmspd.r1."  # the format's version: a later one can still open these
_NONCE = 12


class Sealed(msgspec.Struct, array_like=True):
    """What a token holds."""

    id: str
    text: str


class Sealer:
    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @staticmethod
    def new_key() -> bytes:
        return AESGCM.generate_key(bit_length=256)

    @classmethod
    def at(cls, data_dir: Path) -> Sealer:
        """The data directory's sealer; its key is made the first time (by one process only)."""
        path = data_dir / KEY_FILE
        if not path.exists():
            private_dir(data_dir)
            # Written whole under another name, then linked into place: a process that reads
            # the key never sees half of it, and of two making one at once, one key wins.
            draft = data_dir / f".{KEY_FILE}.{os.getpid()}"
            fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, cls.new_key())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                with contextlib.suppress(FileExistsError):
                    os.link(draft, path)
            finally:
                draft.unlink()
        key = path.read_bytes()
        if len(key) != 32:
            raise ValueError(f"{path} is not a reasoning key (32 bytes); remove it to make a new one")
        return cls(key)

    def seal(self, owner: str, item_id: str, text: str) -> str:
        nonce = os.urandom(_NONCE)
        sealed = self._aead.encrypt(nonce, msgspec.json.encode(Sealed(item_id, text)), owner.encode())
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode().rstrip("=")

    def open(self, owner: str, token: str, param: str) -> Sealed:
        """The reasoning in ``token``; a 400 naming ``param`` unless this server sealed it for
        ``owner``."""
        refused = InvalidRequestError(
            f"{param} does not verify: it was not sealed by this server for this caller", param=param
        )
        if not token.startswith(PREFIX):
            raise refused
        body = token[len(PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            plain = self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], owner.encode())
            return msgspec.json.decode(plain, type=Sealed)
        except (binascii.Error, ValueError, InvalidTag, msgspec.DecodeError):
            raise refused from None
