"""Engine benchmark: raw mlx-lm in this process vs lmspd's engine process, side by side.

    python -m bench.engine [--model NAME] [--tokens 64] [--batch-tokens 32]

Prints decode tok/s and time to first token for one stream (raw ``stream_generate``
vs the engine through its process boundary), and aggregate tok/s for 4 and 8
concurrent requests (raw ``batch_generate`` vs the engine's continuous batching).
Both sides run the same weights (the engine's ``auto`` choice is applied to raw
mlx-lm too), greedy, with end-of-sequence ignored so every run decodes the same
number of tokens. Each measurement is the best of ``--rounds``, alternating sides.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

from lmspd.config import EngineConfig, load_config
from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ModelRegistry, ResolvedModel
from lmspd.prompting.generation import tokenizer_for

PROMPTS = [
    "Write a long story about a dragon and a knight.",
    "Explain how a steam engine works, in detail.",
    "Describe the history of the city of Rome.",
    "Write a poem about the sea at night.",
    "List many facts about the planet Jupiter.",
    "Tell me about the life of bees in a hive.",
    "Describe a walk through a forest in autumn.",
    "Explain why the sky is blue, step by step.",
]


def prompt_ids(model: ResolvedModel, text: str) -> list[int]:
    return tokenizer_for(model).encode_chat([{"role": "user", "content": text}])


# --- raw mlx-lm -----------------------------------------------------------------------------


def load_raw(model: ResolvedModel, dtype: str) -> tuple[Any, Any]:
    from mlx_lm import load

    from lmspd.engine.weights import apply_weight_dtype

    raw, tok = load(str(model.path))
    apply_weight_dtype(raw, dtype)
    tok.eos_token_ids = set()  # decode exactly max_tokens, like the engine run below
    return raw, tok


def raw_single(raw: Any, tok: Any, ids: list[int], n: int) -> tuple[float, float]:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    start = time.perf_counter()
    first = last = 0.0
    count = 0
    for _ in stream_generate(raw, tok, ids, max_tokens=n, sampler=make_sampler(0.0)):
        last = time.perf_counter()
        first = first or last
        count += 1
    return (count - 1) / (last - first), first - start


def raw_batch(raw: Any, tok: Any, prompts: list[list[int]], n: int) -> float:
    from mlx_lm import batch_generate

    start = time.perf_counter()
    out = batch_generate(raw, tok, prompts, max_tokens=n, return_token_ids=True)
    assert out.token_ids is not None
    return sum(len(t) for t in out.token_ids) / (time.perf_counter() - start)


# --- the engine ---------------------------------------------------------------------------


def command(model: ResolvedModel, ids: list[int], n: int) -> p.Generate:
    return p.Generate(
        request_id=uuid.uuid4().hex,
        model=model.name,
        path=str(model.path),
        prompt=ids,
        max_tokens=n,
        sampling=p.SamplingParams(temperature=0.0),
        stop_token_ids=[],
    )


async def engine_single(engine: EngineClient, model: ResolvedModel, ids: list[int], n: int) -> tuple[float, float]:
    start = time.perf_counter()
    first = last = 0.0
    count = 0
    async for ev in engine.generate(command(model, ids, n)):
        if isinstance(ev, p.Delta):
            last = time.perf_counter()
            first = first or last
            count += len(ev.token_ids)
    return (count - 1) / (last - first), first - start


async def engine_batch(engine: EngineClient, model: ResolvedModel, prompts: list[list[int]], n: int) -> float:
    async def one(ids: list[int]) -> int:
        count = 0
        async for ev in engine.generate(command(model, ids, n)):
            if isinstance(ev, p.Delta):
                count += len(ev.token_ids)
        return count

    start = time.perf_counter()
    total = sum(await asyncio.gather(*(one(ids) for ids in prompts)))
    return total / (time.perf_counter() - start)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--weight-dtype", default="auto")
    args = parser.parse_args()

    config = load_config()
    model = ModelRegistry(config).resolve(args.model or config.default_model)
    engine = EngineClient(EngineConfig(weight_dtype=args.weight_dtype, max_concurrency=8))
    ready = await engine.start()
    dtype = (await engine.load(model.name, str(model.path))).weight_dtype
    raw, tok = load_raw(model, dtype)
    print(f"model {model.name} | backend {ready.backend} | mlx {ready.mlx_version} | weights {dtype}")

    ids = prompt_ids(model, PROMPTS[0])
    raw_single(raw, tok, ids, 4)  # warm-up both sides
    await engine_single(engine, model, ids, 4)
    raw_runs, eng_runs = [], []
    for _ in range(args.rounds):
        raw_runs.append(raw_single(raw, tok, ids, args.tokens))
        eng_runs.append(await engine_single(engine, model, ids, args.tokens))
    r_tps, r_ttft = max(raw_runs)[0], min(r[1] for r in raw_runs)
    e_tps, e_ttft = max(eng_runs)[0], min(r[1] for r in eng_runs)
    print(f"\nsingle stream, {len(ids)}-token prompt, {args.tokens} tokens (best of {args.rounds})")
    print(f"  {'':<22}{'decode tok/s':>14}{'first token s':>15}")
    print(f"  {'raw stream_generate':<22}{r_tps:>14.2f}{r_ttft:>15.3f}")
    print(f"  {'lmspd engine':<22}{e_tps:>14.2f}{e_ttft:>15.3f}")
    print(f"  ratio engine/raw: decode {e_tps / r_tps:.3f}x (goal >= 0.97), first token +{e_ttft - r_ttft:.3f}s")

    for n in (4, 8):
        prompts = [prompt_ids(model, t) for t in PROMPTS[:n]]
        raw_b = max(raw_batch(raw, tok, prompts, args.batch_tokens) for _ in range(args.rounds))
        eng_b = max([await engine_batch(engine, model, prompts, args.batch_tokens) for _ in range(args.rounds)])
        print(f"\n{n} concurrent requests x {args.batch_tokens} tokens, aggregate tok/s incl. prefill")
        print(
            f"  raw batch_generate {raw_b:8.2f} | lmspd engine {eng_b:8.2f} | ratio {eng_b / raw_b:.3f}x (goal >= 0.95)"
        )
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
