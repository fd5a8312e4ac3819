"""Logprobs from the real engine process with the tiny model, and the pieces they are made of."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from harness.generation import PROMPTS, collect, deltas_of, request
from lmspd.engine import protocol as p
from lmspd.engine.logprobs import LOGPROB_FLOOR, TokenPieces, top_logprobs
from lmspd.engine.process import EngineClient
from lmspd.errors import InvalidRequestError
from lmspd.models.registry import ResolvedModel
from lmspd.prompting.generation import tokenizer_for


def with_logprobs(cmd: p.Generate, k: int | None) -> p.Generate:
    return msgspec.structs.replace(cmd, logprobs=k)


def entries(deltas: list[p.Delta]) -> list[p.TokenLogprob]:
    return [e for d in deltas for e in d.logprobs or []]


async def test_greedy_logprobs_pick_the_most_likely_token(engine: EngineClient, tiny: ResolvedModel) -> None:
    deltas, fin = await deltas_of(engine, with_logprobs(request(tiny, PROMPTS[0], max_tokens=24), 5))
    assert fin.completion_tokens == 24
    for d in deltas:
        assert d.logprobs is not None
        assert len(d.logprobs) == len(d.token_ids)
    got = entries(deltas)
    assert len(got) == 24
    for e in got:
        top = e.top_logprobs
        assert len(top) == 5
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        # Greedy decoding chose the argmax, so the token heads its own alternatives.
        assert abs(e.logprob - max(t.logprob for t in top)) < 1e-5
        assert (top[0].token, top[0].bytes) == (e.token, e.bytes)
        assert e.logprob <= 0 and all(t.logprob <= 0 for t in top)
        assert len({bytes(t.bytes) for t in top}) == 5  # distinct tokens
    # The bytes of consecutive tokens rebuild the text exactly.
    ids = [i for d in deltas for i in d.token_ids]
    assert b"".join(bytes(e.bytes) for e in got) == tokenizer_for(tiny).decode(ids).encode()


async def test_zero_top_logprobs_gives_only_the_chosen_token(engine: EngineClient, tiny: ResolvedModel) -> None:
    deltas, _ = await deltas_of(engine, with_logprobs(request(tiny, PROMPTS[1], max_tokens=8), 0))
    got = entries(deltas)
    assert len(got) == 8
    assert all(e.top_logprobs == [] and e.logprob <= 0 for e in got)


async def test_no_logprobs_unless_asked_and_asking_changes_no_token(engine: EngineClient, tiny: ResolvedModel) -> None:
    plain = request(tiny, PROMPTS[2], max_tokens=16)
    deltas, _ = await deltas_of(engine, plain)
    assert deltas and all(d.logprobs is None for d in deltas)
    # One request with logprobs and one without share a batch; each gets what it asked for.
    (asked, _), (alone, _) = await asyncio.gather(
        deltas_of(engine, with_logprobs(request(tiny, PROMPTS[2], max_tokens=16), 20)),
        deltas_of(engine, request(tiny, PROMPTS[2], max_tokens=16)),
    )
    assert all(d.logprobs is None for d in alone)
    assert len(entries(asked)) == 16
    assert all(len(e.top_logprobs) == 20 for e in entries(asked))
    tokens = [[i for d in ds for i in d.token_ids] for ds in (deltas, asked, alone)]
    assert tokens[0] == tokens[1] == tokens[2]


async def test_stop_string_keeps_logprobs_aligned_with_tokens(engine: EngineClient, tiny: ResolvedModel) -> None:
    _, text, _ = await collect(engine, request(tiny, PROMPTS[0], max_tokens=30))
    cmd = with_logprobs(request(tiny, PROMPTS[0], max_tokens=30, stop=[text[10:14]]), 2)
    deltas, fin = await deltas_of(engine, cmd)
    assert fin.reason == "stop"
    assert all(len(d.logprobs or []) == len(d.token_ids) for d in deltas)
    assert len(entries(deltas)) == fin.completion_tokens


@pytest.mark.parametrize("k", [-1, 21])
async def test_engine_rejects_out_of_range_top_logprobs(engine: EngineClient, tiny: ResolvedModel, k: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await collect(engine, with_logprobs(request(tiny, PROMPTS[1], max_tokens=4), k))
    assert info.value.param == "top_logprobs"
    assert (await collect(engine, request(tiny, PROMPTS[1], max_tokens=3)))[2].completion_tokens == 3


@pytest.mark.parametrize("k", [None, 0, 20])
def test_validate_top_logprobs_accepts_the_range(k: int | None) -> None:
    p.validate_top_logprobs(k)


def test_token_pieces_are_exact_bytes_with_escaped_partial_characters(tiny: ResolvedModel) -> None:
    tok = tokenizer_for(tiny)
    pieces = TokenPieces(tok)
    text = "héllo 😊 © 2+2"
    ids = tok.encode(text)
    assert b"".join(bytes(pieces.piece(i)[1]) for i in ids) == text.encode()
    # The emoji's four bytes span two tokens: neither is UTF-8 on its own.
    (smile,) = (i for i in ids if 0xF0 in pieces.piece(i)[1])
    token, raw = pieces.piece(smile)
    assert raw == [0x20, 0xF0, 0x9F, 0x98]
    assert token == " \\xf0\\x9f\\x98"
    assert pieces.piece(tok.encode("é")[0]) == ("é", [0xC3, 0xA9])
    # Special tokens are plain text, not byte-level spellings.
    assert pieces.piece(2) == ("<|im_end|>", list(b"<|im_end|>"))


def test_top_logprobs_floor_and_ties() -> None:
    import mlx.core as mx

    inf = float("inf")
    rows = [mx.array([-1.0, -0.5, -inf, -0.5]), mx.array([-inf, -0.1, -3.0, -inf])]
    chosen, tops = top_logprobs(rows, [1, 0], [3, 4])
    assert chosen == [-0.5, LOGPROB_FLOOR]
    assert tops[0] == [(1, -0.5), (3, -0.5), (0, -1.0)]  # a tie goes to the lower id, as argmax does
    assert tops[1][:2] == [(1, pytest.approx(-0.1)), (2, -3.0)]
    assert [v for _, v in tops[1][2:]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
