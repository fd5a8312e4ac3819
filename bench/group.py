"""One model on one process against the same model split over two ranks of an engine group
(docs/distributed.md), side by side in one run: decode speed, first-token time, what each rank
holds, and the bytes a token sends between the ranks.

    python -m bench.group [--model-dir DIR] [--layered] [--tokens 128] [--rounds 3]

Both are real engine processes (``EngineClient``, as ``lmspd serve`` spawns them); the group's
second rank is a real ``lmspd engine join`` over loopback. The two configurations alternate,
each round; medians are printed. On one machine the two ranks share its cores, and a step's
passes run one rank after the other, so this measures correctness's cost and the memory split,
not the speed two hosts would give: a split model is for a model that does not fit one host.

Bytes per token: a step sends the hidden state from rank 1 to rank 0 (4·D bytes per row), the
final state gathered to both ranks (4·D each way) and rank 0's tick (a few bytes over the
control channel): counted from the model's width, as ``engine/group`` sends them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from harness.generation import request
from harness.group import Joiner, loopback_hosts
from harness.models import LAYERED, make_tiny_model
from lmspd.config import EngineConfig
from lmspd.engine import protocol as p
from lmspd.engine.process import EngineClient
from lmspd.models.registry import ResolvedModel

MIB = 1 << 20
PROMPTS = [f"Write a long story about a lighthouse keeper, part {i}." for i in range(64)]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def timed(engine: EngineClient, model: ResolvedModel, prompt: str, tokens: int) -> tuple[float, float]:
    """First-token seconds and decode tokens/s after it, one greedy stream."""
    start = time.perf_counter()
    first = 0.0
    n = 0
    async for ev in engine.generate(request(model, prompt, max_tokens=tokens)):
        if isinstance(ev, p.Delta) and ev.token_ids:
            if not first:
                first = time.perf_counter()
            n += len(ev.token_ids)
    end = time.perf_counter()
    return first - start, (n - 1) / (end - first)


async def main(args: argparse.Namespace) -> None:
    # Here, not above: the engine processes this spawns import this module, and MLX must not be
    # imported before they choose their BLAS (engine/worker.py).
    from lmspd.engine.group.ring import Tick

    work = Path(tempfile.mkdtemp(prefix="bench-group-"))
    model = ResolvedModel(name=args.model_dir.name, path=args.model_dir)
    if args.layered:
        path = make_tiny_model(work / "layered", args.model_dir, shape=LAYERED, context=4096)
        model = ResolvedModel(name="layered", path=path)
    hosts = loopback_hosts()
    with Joiner(work, hosts, timeout_secs=60) as joiner:
        solo = EngineClient(EngineConfig(prompt_cache_max_bytes=0))
        group = EngineClient(EngineConfig(hosts=hosts, group_timeout_secs=60))
        await solo.start()
        await group.start()
        whole = await solo.load(model.name, str(model.path))
        split = await group.load(model.name, str(model.path))
        prompts = iter(PROMPTS)
        figures: dict[str, list[tuple[float, float]]] = {"one process": [], "two ranks": []}
        for _ in range(args.rounds):
            for name, engine in (("one process", solo), ("two ranks", group)):
                figures[name].append(await timed(engine, model, next(prompts), args.tokens))
        assert solo.process is not None and group.process is not None
        width = int(model_width(model.path))
        print(f"{model.name}: {args.tokens} tokens, one stream, medians of {args.rounds} alternating rounds")
        print(f"{'':<12} {'tok/s':>8} {'first token':>12} {'weights held':>24} {'RSS':>18}")
        one_tok = statistics.median(f[1] for f in figures["one process"])
        for name in ("one process", "two ranks"):
            tok = statistics.median(f[1] for f in figures[name])
            ttft = statistics.median(f[0] for f in figures[name])
            if name == "one process":
                held = f"{whole.resident_bytes / MIB:.0f} MiB"
                mem = f"{rss(solo.process.pid or 0) / MIB:.0f} MiB"
            else:
                held = " + ".join(f"{h.resident_bytes / MIB:.0f}" for h in split.hosts) + " MiB"
                mem = f"{rss(group.process.pid or 0) / MIB:.0f} + {rss(joiner.rank_pid()) / MIB:.0f} MiB"
            print(f"{name:<12} {tok:>8.1f} {ttft * 1e3:>10.1f} ms {held:>24} {mem:>18}")
        two_tok = statistics.median(f[1] for f in figures["two ranks"])
        share = max(h.resident_bytes for h in split.hosts) / whole.resident_bytes
        print(
            f"two ranks / one process: decode {two_tok / one_tok:.2f}x; "
            f"the larger rank holds {share:.2f} of the weights"
        )
        tick = len(msgspec.msgpack.encode(Tick(1_000_000, [], [])))  # a busy loop's, with no command
        up, down = 4 * width * 2, 4 * width + 4 + tick
        print(f"bytes per token (one stream): rank 1 -> 0 {up}, rank 0 -> 1 {down} (hidden size {width})")
        print(f"link measured when the group formed: {split.hosts[0].link_bytes_per_sec / MIB:.0f} MiB/s")
        await group.close()
        await solo.close()


def model_width(path: Path) -> int:
    import json

    return int(json.loads((path / "config.json").read_text())["hidden_size"])


if __name__ == "__main__":
    from bench.step_profile import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="an mlx-lm model directory (default: the bundled)")
    parser.add_argument("--layered", action="store_true", help="a random 450M Llama of 24 layers instead")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    ns.model_dir = Path(ns.model_dir or default_model_dir())
    asyncio.run(main(ns))
