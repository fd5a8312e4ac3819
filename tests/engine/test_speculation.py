"""Speculation (engine/speculation.py, upstream/stepping.py's ``StepNow``): the drafts a
sequence's own n-grams give, and, on the bundled model packed as the engine packs it, that a
pass of a few rows computes each row with a decode step's bits and that a lone greedy request
verifying drafts hands out exactly the tokens and logprobs plain decoding does, on both
numerics paths, with a request joining while verified tokens wait, and never past its
``max_tokens``."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as caches
from mlx_lm.utils import load_model

from lmspd.engine import kernels
from lmspd.engine.speculation import MAX_PAUSE, MISS_PAUSE, Drafter, Ngrams, PromptLookup
from lmspd.engine.upstream import stepping
from lmspd.engine.weights import apply_numerics, apply_weight_dtype

generate = importlib.import_module("mlx_lm.generate")
sample_utils = importlib.import_module("mlx_lm.sample_utils")

# A prompt the answer repeats: the model copies the code (SmolLM2-135M does, greedy).
CODE = (
    "def area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
REPEAT = (
    "<|im_start|>user\nRewrite this Python code with the same names:\n```python\n"
    + CODE
    + "```<|im_end|>\n<|im_start|>assistant\n```python\n"
)


# --- the lookup ---------------------------------------------------------------------------


def ngrams(tokens: list[int]) -> Ngrams:
    n = Ngrams()
    n.extend(tokens)
    return n


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_tail() -> None:
    assert ngrams([1, 2, 3, 4, 5, 9, 1, 2, 3]).draft(4) == [4, 5, 9, 1]
    # The latest occurrence wins: 7 8 was followed by 1 last time.
    assert ngrams([7, 8, 5, 5, 7, 8, 1, 0, 7, 8]).draft(2) == [1, 0]
    assert ngrams([1, 2, 3, 4, 5, 9, 1, 2, 3]).draft(2) == [4, 5]
    # The longest n-gram that occurred: 2 3 4 was followed by 6, 3 4 alone last by 8.
    assert ngrams([2, 3, 4, 6, 0, 3, 4, 8, 2, 3, 4]).draft(1) == [6]


def test_no_draft_without_an_earlier_bigram() -> None:
    assert ngrams([1, 2, 3, 4]).draft(4) == []
    assert ngrams([5, 1, 5]).draft(4) == []  # a single repeated token proposes nothing
    assert ngrams([]).draft(4) == []
    assert ngrams([1, 2, 1, 2]).draft(0) == []


def test_a_draft_stops_at_the_end_of_what_is_known() -> None:
    assert ngrams([1, 2, 3, 1, 2]).draft(8) == [3, 1, 2]


def test_the_index_follows_tokens_appended_and_taken_back() -> None:
    n = ngrams([1, 2, 3])
    assert n.draft(2) == []
    n.extend([9, 1, 2])
    assert n.draft(2) == [3, 9]
    n.truncate(4)  # [1, 2, 3, 9]: the tail 3 9 never occurred before
    assert n.draft(2) == []
    n.extend([4, 3, 9])
    assert n.draft(3) == [4, 3, 9]


def test_the_policy_grows_while_drafts_are_kept_and_pauses_after_misses() -> None:
    policy = PromptLookup(max_draft=16)
    assert policy.length() == 4
    policy.kept(4, 4)
    assert policy.length() == 8
    policy.kept(8, 8)
    policy.kept(16, 16)
    assert policy.length() == 16
    policy.kept(16, 3)
    assert policy.length() == 4 and not policy.waiting()

    def pause() -> int:
        steps = 0
        while policy.waiting():
            policy.wait()
            steps += 1
        return steps

    policy.kept(4, 0)  # none kept: one step without a draft, then two, then four...
    assert pause() == 1 and policy.length() == 1
    policy.kept(1, 0)
    assert pause() == 2
    for _ in range(10):
        policy.kept(1, 0)
    assert policy.pause == MAX_PAUSE
    pause()
    policy.kept(1, 1)
    assert policy.backoff == 0 and policy.length() == 2
    policy.missed()
    assert pause() == MISS_PAUSE


def test_a_drafter_looks_up_nothing_while_paused() -> None:
    drafter = Drafter(16)
    assert drafter.propose([1, 2, 3, 4], [9], 8) == []  # nothing to find: a miss pauses it
    assert drafter.waiting()
    assert drafter.propose([1, 2, 3, 4, 9], [1], 8) == []  # paused: no lookup, a step of the pause
    while drafter.waiting():
        drafter.wait()
    assert drafter.propose([1, 2, 3, 4, 9, 1, 2], [3], 8) == [4, 9, 1, 2]  # the first draft: 4 tokens


# --- rows with a decode step's bits ---------------------------------------------------------


@pytest.fixture(scope="module")
def packed(smol_dir: Path) -> Any:
    model = load_model(smol_dir)[0]
    assert apply_weight_dtype(model, "quantized_float32") == "quantized_float32"
    mx.eval(model.parameters())
    return model


@pytest.fixture(params=["exact", "fast"])
def numerics(request: pytest.FixtureRequest, packed: Any) -> Iterator[str]:
    apply_numerics(packed, "quantized_float32", request.param)
    yield request.param
    apply_numerics(packed, "quantized_float32", "exact")


@pytest.mark.parametrize("kind", ["kv", "batch"])
def test_a_pass_of_a_few_rows_carries_a_decode_steps_bits(packed: Any, numerics: str, kind: str) -> None:
    """Eight tokens after a prompt, one a pass against chunks of 2, 3 and 8: every row's logits
    the same bits (what lets a verified draft stand for decoding)."""
    prompt, more = list(range(300, 361)), [5, 900, 77, 1234, 42, 8, 999, 3000]

    def logits(chunk: int) -> list[mx.array]:
        cache = caches.make_prompt_cache(packed) if kind == "kv" else [caches.BatchKVCache([0]) for _ in packed.layers]
        packed(mx.array([prompt]), cache=cache)
        rows: list[mx.array] = []
        for i in range(0, len(more), chunk):
            out = packed(mx.array([more[i : i + chunk]]), cache=cache)[0]
            mx.eval(out)
            rows.extend(out[j] for j in range(out.shape[0]))
        return rows

    decoded = logits(1)
    assert packed._decode_rows == 32
    for chunk in (2, 3, 8):
        got = logits(chunk)
        assert all(mx.array_equal(a, b).item() for a, b in zip(decoded, got, strict=True)), (numerics, chunk)


def test_each_row_attention_is_each_rows_own_decode_attention() -> None:
    ext = kernels.load()
    q = mx.random.normal((2, 4, 6, 32), key=mx.random.key(1))
    k = mx.random.normal((2, 2, 40, 32), key=mx.random.key(2))[..., :20, :]
    v = mx.random.normal((2, 2, 40, 32), key=mx.random.key(3))[..., :20, :]
    padded = (mx.arange(14, 20)[:, None] >= mx.arange(20)[None]) & (
        mx.arange(20)[None] >= mx.array([0, 3])[:, None, None, None]
    )
    for mask, causal in ((None, True), (padded, False)):
        got = ext.attention(q, k, v, mask, 0.2, causal, True)
        for i in range(6):
            m = None if mask is None else padded[..., i : i + 1, : 15 + i]
            one = ext.attention(q[:, :, i : i + 1], k[..., : 15 + i, :], v[..., : 15 + i, :], m, 0.2)
            assert mx.array_equal(got[:, :, i : i + 1], one).item(), (i, causal)
    # A mask that lets a row see a later key is not a decode step's: the whole call is MLX's.
    seeing = padded | (mx.arange(20)[None] == 19)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=seeing)
    assert mx.array_equal(ext.attention(q, k, v, seeing, 0.2, False, True), want).item()


# --- a lone greedy request speculating ------------------------------------------------------


@pytest.fixture
def speculating(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(generate, "GenerationBatch", stepping.StepNow)
    monkeypatch.setattr(generate.BatchGenerator, "_next", stepping._next)
    yield


def tokenize(smol_dir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(smol_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids)


def decode(
    model: Any,
    prompts: list[list[int]],
    max_draft: int,
    max_tokens: int,
    join_when_kept: bool = False,
    sampler: Any = None,
) -> tuple[list[list[tuple[int, mx.array]]], int, int]:
    """Each prompt's tokens and logprobs (the second inserted at the start, or, with
    ``join_when_kept``, once verified tokens wait), and the drafted and kept counts."""
    stepping.StepNow.max_draft, stepping.StepNow.drafter = max_draft, Drafter
    gen = generate.BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    out: dict[int, list[tuple[int, mx.array]]] = {}
    samplers = None if sampler is None else [sampler]
    uids = list(gen.insert([prompts[0]], max_tokens=[max_tokens], samplers=samplers))
    if not join_when_kept:
        uids += gen.insert(prompts[1:], max_tokens=[max_tokens] * (len(prompts) - 1))
    drafted = accepted = 0
    try:
        for _ in range(2000):
            batch = gen._generation_batch
            if join_when_kept and len(uids) < len(prompts) and getattr(batch, "_kept", None):
                uids += gen.insert(prompts[1:], max_tokens=[max_tokens] * (len(prompts) - 1))
            for r in gen.next()[1]:
                out.setdefault(r.uid, []).append((r.token, r.logprobs))
            drafted = max(drafted, getattr(batch, "drafted", 0))
            accepted = max(accepted, getattr(batch, "accepted", 0))
            if len(uids) == len(prompts) and all(len(out.get(u, [])) == max_tokens for u in uids):
                break
    finally:
        stepping.StepNow.max_draft, stepping.StepNow.drafter = 0, None
        gen.close()
    return [out[u] for u in uids], drafted, accepted


def same(a: list[tuple[int, mx.array]], b: list[tuple[int, mx.array]]) -> bool:
    if [t for t, _ in a] != [t for t, _ in b]:
        return False
    return all(mx.array_equal(x, y).item() for (_, x), (_, y) in zip(a, b, strict=True))


def test_a_greedy_request_hands_out_decodings_tokens_and_logprobs(
    packed: Any, numerics: str, smol_dir: Path, speculating: None
) -> None:
    prompt = tokenize(smol_dir, REPEAT)
    (plain,), drafted, _ = decode(packed, [prompt], 0, 48)
    assert drafted == 0
    (spoken,), drafted, accepted = decode(packed, [prompt], 16, 48)
    assert accepted >= 10 and drafted >= accepted, (drafted, accepted)  # drafts kept: the test means something
    assert same(plain, spoken), numerics


def test_a_request_joining_while_verified_tokens_wait_changes_nothing(
    packed: Any, smol_dir: Path, speculating: None
) -> None:
    prompts = [tokenize(smol_dir, REPEAT), tokenize(smol_dir, "<|im_start|>user\nName three rivers.<|im_end|>\n")]
    alone = [decode(packed, [p], 0, 40)[0][0] for p in prompts]
    (first, second), _, accepted = decode(packed, prompts, 16, 40, join_when_kept=True)
    assert accepted > 0
    assert same(first, alone[0]) and same(second, alone[1])


def test_drafts_stop_at_max_tokens(packed: Any, smol_dir: Path, speculating: None) -> None:
    prompt = tokenize(smol_dir, REPEAT)
    for max_tokens in (1, 2, 19):
        (plain,), _, _ = decode(packed, [prompt], 0, max_tokens)
        (spoken,), _, _ = decode(packed, [prompt], 16, max_tokens)
        assert len(spoken) == max_tokens and same(plain, spoken)


def test_a_sampled_request_never_drafts(packed: Any, smol_dir: Path, speculating: None) -> None:
    sampler = sample_utils.make_sampler(temp=0.7)
    _, drafted, _ = decode(packed, [tokenize(smol_dir, REPEAT)], 16, 40, sampler=sampler)
    assert drafted == 0


def test_a_model_without_the_row_promise_never_drafts(smol_dir: Path, speculating: None) -> None:
    model = load_model(smol_dir)[0]  # MLX's own quantized products: a pass's rows are not decode steps
    _, drafted, _ = decode(model, [tokenize(smol_dir, REPEAT)], 16, 40)
    assert drafted == 0


# --- a resumed request's tokens, in decode-sized pieces ---------------------------------------


def test_a_resumed_requests_generated_tokens_go_in_pieces_of_decode_rows() -> None:
    from lmspd.engine.admission import DECODE_ROWS, resumed_segments

    tokens = list(range(100))  # a prompt of 10, then 90 generated
    segments = resumed_segments(tokens, 0, 10)
    assert segments[0] == tokens[:9] and [len(s) for s in segments[1:]] == [32, 32, 27]
    assert [t for s in segments for t in s] == tokens
    assert resumed_segments(tokens, 9, 10)[0] == tokens[9:41]  # the prompt cached but its last token
    assert resumed_segments(tokens, 60, 10) == [tokens[60:92], tokens[92:]]  # generated tokens cached too
    assert resumed_segments(tokens[:10], 0, 10) == [tokens[:9], [9]]  # nothing generated: as before
    from lmspd.engine.packed import KERNEL_ROWS

    assert DECODE_ROWS == KERNEL_ROWS  # the admission cannot import packed (MLX): the two agree
