"""Sealed reasoning (lmspd.responses.sealing): what opens, and everything that must not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmspd.errors import InvalidRequestError
from lmspd.responses.sealing import KEY_FILE, PREFIX, Sealed, Sealer


def test_a_seal_opens_for_its_owner_with_its_key_only(tmp_path: Path) -> None:
    sealer = Sealer.at(tmp_path)
    token = sealer.seal("alice", "rs_1", "thinking, in full\n")
    assert token.startswith(PREFIX) and "thinking" not in token
    assert sealer.open("alice", token, "input[0].encrypted_content") == Sealed("rs_1", "thinking, in full\n")
    assert Sealer.at(tmp_path).open("alice", token, "p").text == "thinking, in full\n"  # the key is kept
    assert sealer.seal("alice", "rs_1", "x") != sealer.seal("alice", "rs_1", "x")  # a fresh nonce each time
    for owner, opener in (("bob", sealer), ("alice", Sealer.at(tmp_path / "other"))):
        with pytest.raises(InvalidRequestError) as refused:
            opener.open(owner, token, "input[3].encrypted_content")
        assert refused.value.param == "input[3].encrypted_content"


def test_tampered_and_foreign_tokens_are_refused(tmp_path: Path) -> None:
    sealer = Sealer.at(tmp_path)
    token = sealer.seal("", "rs_1", "abc")
    body = token[len(PREFIX) :]
    for bad in (
        "",
        PREFIX,
        body,
        token[:-1],
        PREFIX + body[:10] + ("A" if body[10] != "A" else "B") + body[11:],
        PREFIX + "!!!not-base64!!!",
        "gAAAAABo-an-openai-token",
    ):
        with pytest.raises(InvalidRequestError):
            sealer.open("", bad, "p")


def test_the_key_file_is_private_and_a_bad_one_is_named(tmp_path: Path) -> None:
    Sealer.at(tmp_path)
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]  # no draft left behind
    os.chmod(tmp_path / KEY_FILE, 0o600)
    (tmp_path / KEY_FILE).write_bytes(b"short")
    with pytest.raises(ValueError, match=KEY_FILE):
        Sealer.at(tmp_path)
