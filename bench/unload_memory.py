"""Whether an unloaded model's memory goes back: a real engine process's RSS before a model
loads, once it is loaded and has answered, and after an operator's unload.

    python -m bench.unload_memory [--model-dir DIR] [--requests 4] [--tokens 32] [--logprobs]
        [--grammar] [--prompt-cache] [--rounds 2]

The engine is the one ``lmspd serve`` spawns (``EngineClient``), on the default settings but
for the prompt cache, which is off unless ``--prompt-cache`` (its entries outlive their model
by design, up to its own bound: docs/operations.md, so they are not the model's memory). Each
round loads the model, runs ``--requests`` requests of ``--tokens`` tokens (with logprobs and a
grammar if asked, so the tokenizers those build are loaded too), unloads it, and reads the
engine's RSS (``EngineStatus.rss_bytes``, /proc/self/statm) at each point. The goal (issue 44):
RSS after the unload within 10% of RSS before the load. The first round also pays what the
engine does once, on its first load (libraries' pages, modules imported, threads started):
each round's last lines name the mappings that grew over it (docs/memory.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import Counter
from pathlib import Path

from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.models.tokenizer import Tokenizer

MIB = 1 << 20


async def rss(engine: EngineClient) -> int:
    return (await engine.status()).rss_bytes


def anon(engine: EngineClient) -> int:
    """The engine's anonymous resident memory (RssAnon: heap, arrays, stacks), without the
    code pages of its libraries (RssFile: clean, shared, dropped by the kernel at need)."""
    assert engine.process is not None and engine.process.pid is not None
    for line in Path(f"/proc/{engine.process.pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def mappings(engine: EngineClient) -> Counter[str]:
    """The engine's resident bytes by mapping (/proc/PID/smaps): each library by its file's
    name, ``[heap]`` (glibc's main arena), ``[anon]`` (mmap'd blocks, other threads' arenas,
    stacks)."""
    assert engine.process is not None and engine.process.pid is not None
    found: Counter[str] = Counter()
    name = "[anon]"
    for line in Path(f"/proc/{engine.process.pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            name = Path(fields[5]).name if len(fields) > 5 and fields[5].startswith("/") else "[anon]"
            name = fields[5] if len(fields) > 5 and fields[5].startswith("[") else name
        elif fields and fields[0] == "Rss:":
            found[name] += int(fields[1]) * 1024
    return found


def kept(before: Counter[str], after: Counter[str]) -> str:
    """The mappings that grew by half a MiB or more: what a round left behind."""
    grown = {k: after[k] - before[k] for k in after if after[k] - before[k] >= MIB // 2}
    return ", ".join(f"{k} +{v / MIB:.1f}" for k, v in sorted(grown.items(), key=lambda kv: -kv[1])) or "none"


async def answer(engine: EngineClient, model_dir: Path, n: int, tokens: int, logprobs: bool, grammar: bool) -> None:
    tok = Tokenizer(model_dir)
    for i in range(n):
        prompt = tok.encode_chat([{"role": "user", "content": f"Tell me about topic {i}."}])
        cmd = p.Generate(
            request_id=f"r{i}",
            model="bench",
            path=str(model_dir),
            prompt=prompt,
            max_tokens=tokens,
            stop_token_ids=tok.eos_token_ids,
            logprobs=2 if logprobs else None,
            grammar='start: /[a-z ]+/ "."' if grammar else None,
        )
        async for _ in engine.generate(cmd):
            pass


async def run(args: argparse.Namespace) -> None:
    from bench.step_profile import default_model_dir

    model_dir = Path(args.model_dir or default_model_dir())
    config = EngineConfig(
        keep_alive_secs=0,  # only the operator's unload, when this bench asks
        prompt_cache_max_bytes=(1 << 30) if args.prompt_cache else 0,
        kernel_dir=os.environ.get("LMSPD_KERNEL_DIR", ""),
    )
    engine = EngineClient(config)
    await engine.start()
    try:
        print(f"engine RSS at start (nothing loaded): {await rss(engine) / MIB:.1f} MiB; RSS in MiB:")
        head = f"{'before':>8}{'loaded':>8}{'answered':>10}{'unloaded':>10}{'returned':>10}{'after/before':>14}"
        print(f"{'round':<7}{head}{'anon after/before':>19}")
        left: list[str] = []
        for r in range(args.rounds):
            before, anon_before, maps = await rss(engine), anon(engine), mappings(engine)
            await engine.load("bench", str(model_dir))
            loaded = await rss(engine)
            await answer(engine, model_dir, args.requests, args.tokens, args.logprobs, args.grammar)
            answered = await rss(engine)
            after = (await engine.unload("bench", force=True)).rss_bytes
            returned = (answered - after) / max(1, answered - before)
            print(
                f"{r + 1:<7}{before / MIB:>8.1f}{loaded / MIB:>8.1f}{answered / MIB:>10.1f}{after / MIB:>10.1f}"
                f"{returned:>10.0%}{after / before:>14.3f}{anon(engine) / anon_before:>19.3f}"
            )
            left.append(f"round {r + 1} left (MiB): {kept(maps, mappings(engine))}")
        print("\n".join(left))
    finally:
        await engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--logprobs", action="store_true", help="requests ask for logprobs (TokenPieces)")
    parser.add_argument("--grammar", action="store_true", help="requests carry a grammar (llguidance)")
    parser.add_argument("--prompt-cache", action="store_true", help="the prompt cache on (1 GiB)")
    args = parser.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
