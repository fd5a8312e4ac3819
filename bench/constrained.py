"""Constrained decoding benchmark: a JSON-schema grammar vs free text, and grammar compile time.

    python -m bench.constrained [--model-dir DIR] [--tokens 128] [--rounds 3] [--batches 1 4] [--only ...]

(a) Decode tok/s of the bundled model (or ``--model-dir``) with a json_schema grammar
vs unconstrained, same engine process, same prompts, alternating sides, for 1 and 4
(``--batches``) concurrent requests; greedy, end-of-sequence ignored, and a schema (an array of
exactly 64 short strings) whose output is longer than ``--tokens``, so both sides
decode the same number of tokens. Decode rate counts from each side's first token
to its last, so prefill is left out. Each figure is the best of ``--rounds``.

(b) Grammar compile time for a 50-property object schema: ``Grammars.matcher`` on
first use (compile) vs later uses (a copy of the compiled grammar), and the first
token mask after each, in ms, median of ``--compiles`` distinct schemas (so the
cold numbers never hit the cache).

(c) The noisy neighbour: one free "victim" stream's decode tok/s alone, beside a free
request, and beside a request whose tool schema is a 1000-entry allOf (tool_choice
required, the grammar compiled cold: each round's schema is new), the neighbour joining
once the victim streams. Sent to the engine directly, short prompts on both: the grammar's
cost alone (intake refuses that schema, and would refuse its 14k-token prompt's effect with
it: docs/reliability.md#grammar-and-schema-attacks). Best of ``--rounds``, as ratios.

``--only compile|decode|noisy`` runs one of them; ``--tiny`` runs them on the tests' tiny
random-weight model (milliseconds a step, where a stall shows most).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.constraint import Grammars
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ResolvedModel
from lmspd.models.tokenizer import Tokenizer
from lmspd.prompting import grammar
from lmspd.responses.tools import JsonSchemaFormat, tool_options

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = "smollm2-135m-instruct"
PROMPTS = [
    "List many animals as JSON.",
    "Give me a long list of colours as JSON.",
    "Name as many fruits as you can, as JSON.",
    "List the words you know, as JSON.",
]
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 64,
            "maxItems": 64,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def default_model_dir() -> Path:
    """Where tests/conftest.py pulls the bundled model."""
    cache = Path(os.environ.get("LMSPD_TEST_CACHE", ROOT / ".test-cache"))
    return cache / "models" / BUNDLED


def schema_grammar(schema: dict[str, Any]) -> str:
    fmt = JsonSchemaFormat(name="out", schema=schema)
    lark = grammar.build(text_format=fmt, tools=tool_options(None, None, None, None), tool_format=None, special={})
    assert lark is not None
    return lark


def command(model: ResolvedModel, ids: list[int], n: int, lark: str | None) -> p.Generate:
    return p.Generate(
        request_id=uuid.uuid4().hex,
        model=model.name,
        path=str(model.path),
        prompt=ids,
        max_tokens=n,
        sampling=p.SamplingParams(temperature=0.0),
        stop_token_ids=[],  # decode exactly max_tokens on the free side
        grammar=lark,
    )


async def decode(engine: EngineClient, cmd: p.Generate) -> tuple[int, float, float]:
    """(tokens, time of the first token, time of the last) for one request."""
    first = last = 0.0
    count = 0
    async for ev in engine.generate(cmd):
        if isinstance(ev, p.Delta) and ev.token_ids:
            last = time.perf_counter()
            first = first or last
            count += len(ev.token_ids)
    return count, first, last


async def decode_rate(
    engine: EngineClient, model: ResolvedModel, prompts: list[list[int]], n: int, lark: str | None
) -> tuple[float, int]:
    """Aggregate decode tok/s of the prompts run together, and the tokens each got (the fewest)."""
    runs = await asyncio.gather(*(decode(engine, command(model, ids, n, lark)) for ids in prompts))
    first = min(r[1] for r in runs)
    last = max(r[2] for r in runs)
    # Tokens after the first one to arrive: the first token of each request is prefill.
    tokens = sum(r[0] for r in runs) - len(runs)
    return tokens / (last - first), min(r[0] for r in runs)


async def bench_decode(model: ResolvedModel, tokens: int, rounds: int, batches: list[int]) -> None:
    tok = Tokenizer(model.path)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS]
    lark = schema_grammar(LONG_SCHEMA)
    engine = EngineClient(EngineConfig(weight_dtype="quantized", max_concurrency=8))
    ready = await engine.start()
    try:
        await engine.load(model.name, str(model.path))
        print(f"model {model.name} | backend {ready.backend} | mlx {ready.mlx_version}")
        # Warm-up: load, compile the grammar, first-call costs on both sides.
        await decode_rate(engine, model, prompts[:1], 4, None)
        await decode_rate(engine, model, prompts[:1], 4, lark)
        print(f"\ndecode tok/s, {tokens} tokens per request, best of {rounds} (alternating)")
        print(f"  {'':<8}{'free':>10}{'json_schema':>13}{'ratio':>8}")
        for batch in batches:
            free: list[float] = []
            constrained: list[float] = []
            for _ in range(rounds):
                rate, got = await decode_rate(engine, model, prompts[:batch], tokens, None)
                assert got == tokens, f"free run decoded {got} tokens, not {tokens}"
                free.append(rate)
                rate, got = await decode_rate(engine, model, prompts[:batch], tokens, lark)
                assert got == tokens, f"constrained run stopped after {got} tokens, not {tokens}"
                constrained.append(rate)
            f, c = max(free), max(constrained)
            print(f"  batch {batch:<2}{f:>10.2f}{c:>13.2f}{c / f:>7.3f}x (goal >= 0.90)")
    finally:
        await engine.close()


def all_of_schema(variant: int, pattern: bool = False) -> dict[str, Any]:
    """The thousand-fold allOf of tests/api/test_grammar_attacks.py (``variant`` names its
    property, so each round compiles anew); ``pattern``: each entry a regex, costlier to merge."""
    value: dict[str, Any] = {"type": "string", **({"pattern": "^[a-z]+$"} if pattern else {})}
    return {"type": "object", "allOf": [{"properties": {f"a{variant}": value}} for _ in range(1000)]}


def tool_grammar(schema: dict[str, Any]) -> str:
    tools = tool_options([{"type": "function", "name": "fill", "parameters": schema}], "required", None, None)
    lark = grammar.build(text_format=None, tools=tools, tool_format="json_tools", special={})
    assert lark is not None
    return lark


async def victim_rate(
    engine: EngineClient, model: ResolvedModel, victim: list[int], n: int, neighbour: p.Generate | None
) -> float:
    """The victim's decode tok/s; ``neighbour`` joins once the victim has its first tokens."""
    first = last = 0.0
    count = 0
    joined: asyncio.Task[tuple[int, float, float]] | None = None
    async for ev in engine.generate(command(model, victim, n, None)):
        if isinstance(ev, p.Delta) and ev.token_ids:
            last = time.perf_counter()
            first = first or last
            count += len(ev.token_ids)
            if neighbour is not None and joined is None and count >= 4:
                joined = asyncio.create_task(decode(engine, neighbour))
    if joined is not None:
        await joined
    return (count - 1) / (last - first)


async def bench_noisy(model: ResolvedModel, tokens: int, rounds: int) -> None:
    tok = Tokenizer(model.path)
    victim, other = (tok.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS[:2])
    engine = EngineClient(EngineConfig(weight_dtype="quantized", max_concurrency=8))
    ready = await engine.start()
    try:
        await engine.load(model.name, str(model.path))
        print(f"\nnoisy neighbour: victim decode tok/s, {tokens} tokens, best of {rounds} | backend {ready.backend}")
        await victim_rate(engine, model, victim, 8, command(model, other, 8, tool_grammar(all_of_schema(-1))))
        sides: dict[str, Any] = {
            "alone": lambda _: None,
            "beside a free request": lambda _: command(model, other, tokens, None),
            "beside the 1000-allOf tool": lambda r: command(model, other, tokens, tool_grammar(all_of_schema(r))),
            "  ...each entry a pattern": lambda r: command(
                model, other, tokens, tool_grammar(all_of_schema(1000 + r, pattern=True))
            ),
        }
        rates: dict[str, list[float]] = {label: [] for label in sides}
        for r in range(rounds):
            for label, neighbour in sides.items():
                rates[label].append(await victim_rate(engine, model, victim, tokens, neighbour(r)))
        alone, free = max(rates["alone"]), max(rates["beside a free request"])
        print(f"  {'':<30}{'tok/s':>8}{'vs alone':>10}{'vs free':>9}")
        for label, got in rates.items():
            best = max(got)
            print(f"  {label:<30}{best:>8.2f}{best / alone:>9.3f}x{best / free:>8.3f}x")
    finally:
        await engine.close()


def wide_schema(variant: int, properties: int = 50) -> dict[str, Any]:
    """An object of ``properties`` mixed-type properties; ``variant`` makes each schema distinct."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 20},
        {"type": "integer", "minimum": 0, "maximum": 1000 + variant},
        {"type": "boolean"},
        {"enum": ["low", "medium", "high"]},
        {"type": "number"},
    ]
    props = {f"field_{variant}_{i}": kinds[i % len(kinds)] for i in range(properties)}
    return {
        "type": "object",
        "properties": props,
        "required": list(props)[: properties // 2],
        "additionalProperties": False,
    }


def bench_compile(model: ResolvedModel, repetitions: int) -> None:
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tok = Tokenizer(model.path)
    grammars = Grammars(model.path, tok.eos_token_ids, tok.vocab_size)
    bitmask = allocate_token_bitmask(1, tok.vocab_size)

    def timed(lark: str) -> tuple[float, float]:
        """ms for ``Grammars.matcher``, and for the first token mask after it (llguidance
        builds parts of the lexer lazily, on the first mask)."""
        start = time.perf_counter()
        matcher = grammars.matcher(lark)
        made = time.perf_counter()
        fill_next_token_bitmask(matcher, bitmask)
        return (made - start) * 1000, (time.perf_counter() - made) * 1000

    timed(schema_grammar(wide_schema(-1)))  # first-use costs of llguidance itself
    cold: list[tuple[float, float]] = []
    warm: list[tuple[float, float]] = []
    for variant in range(repetitions):
        lark = schema_grammar(wide_schema(variant))
        cold.append(timed(lark))
        warm += [timed(lark) for _ in range(3)]
    print(f"\ngrammar for a 50-property object schema, ms, median of {repetitions} distinct schemas")
    print(f"  {'':<22}{'matcher':>10}{'first mask':>12}")
    for label, runs, goal in (("compile (first use)", cold, "< 50"), ("copy (cached)", warm, "~0")):
        made, mask = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"  {label:<22}{made:>10.2f}{mask:>12.2f}   (matcher max {max(r[0] for r in runs):.2f}; goal {goal})")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compiles", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], choices=range(1, len(PROMPTS) + 1))
    parser.add_argument("--only", choices=["compile", "decode", "noisy"], default=None)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random-weight model")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="lmspd-bench-") as scratch:
        if args.tiny:
            from harness.fuzz import tiny_model

            args.model_dir = tiny_model(Path(scratch) / "tiny")
        path: Path = (args.model_dir or default_model_dir()).resolve()
        if not (path / "config.json").is_file():
            parser.error(f"no model at {path}: run the tests once to pull it, or pass --model-dir")
        model = ResolvedModel(name=path.name, path=path)
        if args.only in (None, "compile"):
            bench_compile(model, args.compiles)
        if args.only in (None, "decode"):
            await bench_decode(model, args.tokens, args.rounds, args.batches)
        if args.only in (None, "noisy"):
            await bench_noisy(model, args.tokens, args.rounds)


if __name__ == "__main__":
    asyncio.run(main())
