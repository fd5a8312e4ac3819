"""The reasoning echo's parts: turn grouping and keys (pure), and its store on a real SQLite
file (byte bound, LRU, owners, restarts). The API acceptance is in test_api_responses_store.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from harness.families import make_family_tokenizer
from lmspd.config import Config, EngineConfig, ResponsesConfig
from lmspd.models.tokenizer import Tokenizer
from lmspd.prompting.prompt import build_prompt
from lmspd.responses import schema as s
from lmspd.responses.inputs import ReasoningItem, parse_items, to_messages
from lmspd.responses.reasoning_echo import ReasoningEcho, enabled, missing, to_remember, turn_key, turns
from lmspd.store.conn import Conn
from lmspd.store.db import Database
from lmspd.store.echo import EchoStore
from lmspd.store.opening import open_database
from lmspd.store.url import StoreUrl

REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "Hm."}],
    "status": None,  # as the server returns it
}
MESSAGE = {
    "type": "message",
    "id": "msg_1",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}],
}
CALL = {
    "type": "function_call",
    "id": "fc_1",
    "call_id": "call_1",
    "name": "f",
    "arguments": "{}",
    "status": "completed",
}
USER = {"role": "user", "content": "Hi"}


def test_turns_group_as_to_messages_renders() -> None:
    items = parse_items(
        [
            USER,
            REASONING,
            MESSAGE,
            CALL,
            {**CALL, "call_id": "call_2"},
            {"type": "function_call_output", "call_id": "call_1", "output": "1"},
            CALL,  # calls after a result: a turn of their own
            USER,
            {"role": "assistant", "content": "Bye."},
            {"role": "assistant", "content": "Again."},  # each assistant message its own turn
        ]
    )
    assert [(t.start, t.end, t.reasoning) for t in turns(items)] == [
        (2, 5, 1),
        (6, 7, None),
        (8, 9, None),
        (9, 10, None),
    ]
    # The same grouping as the rendering: one assistant message per turn.
    assert len([m for m in to_messages(items) if m["role"] == "assistant"]) == 4


def test_key_ignores_ids_statuses_and_content_shape() -> None:
    sent_back = parse_items([{"role": "assistant", "content": "Hello."}, {**CALL, "id": None, "status": None}])
    returned = parse_items([MESSAGE, CALL])
    assert turn_key(sent_back) == turn_key(returned)
    assert turn_key(parse_items([{"role": "assistant", "content": "Hello!"}, CALL])) != turn_key(returned)
    assert turn_key(parse_items([MESSAGE, {**CALL, "call_id": "call_9"}])) != turn_key(returned)
    assert turn_key(parse_items([MESSAGE, {**CALL, "arguments": '{"a":1}'}])) != turn_key(returned)


def test_to_remember_takes_reasoning_that_a_turn_follows() -> None:
    output = msgspec.convert([REASONING, MESSAGE, CALL], list[s.OutputItem])
    ((key, item),) = to_remember(output)
    assert key == turn_key(parse_items([MESSAGE, CALL]))
    assert msgspec.json.decode(item) == REASONING
    # Reasoning cut off before any answer: nothing to key it by.
    assert to_remember(msgspec.convert([REASONING], list[s.OutputItem])) == []
    assert to_remember(msgspec.convert([MESSAGE], list[s.OutputItem])) == []


def test_missing_lists_turns_without_reasoning() -> None:
    items = parse_items([USER, REASONING, MESSAGE, USER, MESSAGE, USER])
    assert missing(items) == [(4, turn_key(parse_items([MESSAGE])))]


def test_enabled_needs_the_prompt_cache_and_a_budget() -> None:
    assert enabled(Config())
    assert not enabled(Config(engine=EngineConfig(prompt_cache_max_bytes=0)))
    assert not enabled(Config(responses=ResponsesConfig(reasoning_echo_max_bytes=0)))


@pytest.fixture
async def db(store_url: StoreUrl) -> AsyncIterator[Database]:
    """On both databases (tests/conftest.py's ``store_url``)."""
    database = await open_database(store_url)
    yield database
    await database.close()


def item(n: int, size: int = 150) -> bytes:
    """A reasoning item of exactly ``size`` bytes of JSON."""

    def encoded(text: str) -> bytes:
        return msgspec.json.encode(
            {**REASONING, "id": f"rs_{n}", "content": [{"type": "reasoning_text", "text": text}]}
        )

    body = encoded("x" * (size - len(encoded(""))))
    assert len(body) == size
    return body


async def test_store_is_bounded_in_bytes_least_recently_used_out(db: Database) -> None:
    store = EchoStore(db, max_bytes=450)
    for n in range(3):
        await store.remember("alice", [(f"k{n}", item(n))])
    assert await store.total_bytes() == 450
    await store.remember("alice", [], touch=["k0"])  # k0 used: k1 is now the oldest
    await store.remember("alice", [("k3", item(3))])
    assert set(await store.lookup("alice", ["k0", "k1", "k2", "k3"])) == {"k0", "k2", "k3"}
    assert await store.total_bytes() == 450
    await store.remember("alice", [("big", item(9, 451))])  # larger than the budget: not kept
    assert await store.lookup("alice", ["big"]) == {}
    assert await store.total_bytes() == 450
    await store.remember("alice", [("k2", item(2, 200))])  # replaced: counted once, at its new size
    assert set(await store.lookup("alice", ["k0", "k2", "k3"])) == {"k2", "k3"}
    assert await store.total_bytes() == 350
    assert await EchoStore(db, max_bytes=200).enforce() == 1  # a lowered budget
    assert set(await store.lookup("alice", ["k2", "k3"])) == {"k2"}


async def test_store_keeps_owners_apart_and_survives_reopening(store_url: StoreUrl) -> None:
    db = await open_database(store_url)
    await EchoStore(db, 1 << 20).remember("alice", [("k", item(1))])
    await db.close()
    db = await open_database(store_url)
    store = EchoStore(db, 1 << 20)
    assert await store.lookup("alice", ["k"]) == {"k": item(1)}
    assert await store.lookup("bob", ["k"]) == {}
    await db.close()


async def test_a_failing_echo_write_does_not_fail_its_transaction(db: Database) -> None:
    job = EchoStore(db, 1000).job("alice", [("k", item(1))])

    def with_task(conn: Conn) -> int:
        conn.execute("DROP TABLE reasoning_echo")  # the echo's write will fail
        job(conn)
        return int(conn.execute("SELECT count(*) FROM tasks").fetchone()[0])

    assert await db.writer.submit(with_task) == 0


async def test_restore_puts_reasoning_back_in_history_and_input(db: Database) -> None:
    echo = ReasoningEcho(EchoStore(db, 1 << 20))
    output = msgspec.convert([REASONING, MESSAGE], list[s.OutputItem])
    await db.writer.submit(echo.store.job("alice", to_remember(output)))  # type: ignore[union-attr]
    plain: dict[str, Any] = {"role": "assistant", "content": "Hello."}
    request = s.ResponseRequest(input=[USER, plain, USER])
    history, restored, used = await echo.restore("alice", [], request)
    assert history == [] and used == [turn_key(parse_items([MESSAGE]))]
    assert restored.input == [USER, REASONING, plain, USER]
    assert request.input == [USER, plain, USER]  # the request as sent is left alone
    # In history (a conversation turn sent by hand earlier), and at the boundary.
    history, restored, _ = await echo.restore("alice", parse_items([USER, plain]), s.ResponseRequest(input="Next"))
    assert history == parse_items([USER, REASONING, plain]) and restored.input == "Next"
    history, restored, _ = await echo.restore("alice", parse_items([USER]), s.ResponseRequest(input=[plain, USER]))
    assert isinstance(parse_items(restored.input)[0], ReasoningItem)  # type: ignore[arg-type]
    # Already there, another owner, or echo off: unchanged.
    with_reasoning = s.ResponseRequest(input=[USER, REASONING, plain, USER])
    assert (await echo.restore("alice", [], with_reasoning))[1] is with_reasoning
    assert (await echo.restore("bob", [], request))[1] is request
    assert (await ReasoningEcho(None).restore("alice", [], request))[1] is request


def test_reasoning_renders_once_where_the_template_places_it(tmp_path: Path, smol_dir: Path) -> None:
    """What the echo puts back must render as generated: the hermes_think template writes
    ``reasoning_content`` itself, so it is not also written inline into the content."""
    tok = Tokenizer(make_family_tokenizer(tmp_path, smol_dir, "hermes_think"))
    plain = {"role": "assistant", "content": "Hello."}
    text = build_prompt(tok, s.ResponseRequest(input=[USER, REASONING, plain, USER]), []).text
    assert text.count("<think>\nHm.\n</think>\n\nHello.<|im_end|>") == 1 and text.count("Hm.") == 1
