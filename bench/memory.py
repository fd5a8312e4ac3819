"""The engine's memory, itemized: what each part of a loaded model and a batch of streams holds.

    python -m bench.memory [--model-dir DIR] [--weight-dtype auto] [--streams 8] [--tokens 32]

One process does what the engine process does, in order, and reads its resident memory
(``/proc/self/status``: VmRSS, and VmHWM for the peak) after each stage, beside MLX's own
accounting (active and cached buffers, its peak): Python and the imports; the weights, loaded
and converted (against the bytes of the model's parameters); the tokenizer; then ``--streams``
streams decoding ``--tokens`` tokens each in one ``BatchGenerator`` (KV, transients), their KV
kept in the prompt cache as the engine keeps a finished request's, and the MLX buffer cache at
the engine's bound. Resident memory counts pages touched, so each row is what that stage added.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

MIB = 1 << 20


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Ledger:
    def __init__(self) -> None:
        self.last = status("VmRSS")
        print(f"{'stage':<56}{'RSS +MiB':>10}{'RSS MiB':>9}  MLX")
        self.row("Python, MLX, mlx-lm and lmspd imported", self.last, "")

    def row(self, name: str, added: int, mlx: str) -> None:
        print(f"{name:<56}{added / MIB:>10.1f}{status('VmRSS') / MIB:>9.1f}  {mlx}")

    def stage(self, name: str, mlx: str = "") -> None:
        now = status("VmRSS")
        self.row(name, now - self.last, mlx)
        self.last = now


def mlx_state() -> str:
    import mlx.core as mx

    return (
        f"active {mx.get_active_memory() / MIB:.1f}, cache {mx.get_cache_memory() / MIB:.1f}, "
        f"peak {mx.get_peak_memory() / MIB:.1f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--weight-dtype", default="auto")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    from lmspd.engine.upstream.blas import load as load_blas

    load_blas("auto")
    from lmspd.engine.upstream.lean import import_mlx_lm

    import_mlx_lm()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load_model

    from bench.step_profile import default_model_dir
    from lmspd.engine.loaded import BUFFER_CACHE_BYTES, bound_buffer_cache
    from lmspd.engine.packed import packed_matrix_bytes
    from lmspd.engine.prompt_cache import PromptCache
    from lmspd.engine.weights import apply_weight_dtype
    from lmspd.models.tokenizer import Tokenizer

    model_dir = Path(args.model_dir or default_model_dir())
    bound_buffer_cache()
    ledger = Ledger()
    model: Any
    model, _ = load_model(model_dir)
    dtype = apply_weight_dtype(model, args.weight_dtype)
    mx.eval(model.parameters())
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    ledger.stage(f"weights ({dtype}; parameters {params / MIB:.1f} MiB)", mlx_state())
    bound_buffer_cache(max(BUFFER_CACHE_BYTES, 2 * packed_matrix_bytes(model)))
    tok = Tokenizer(model_dir)
    ledger.stage("the tokenizer")
    prompts = [tok.encode_chat([{"role": "user", "content": f"Write about topic {i}."}]) for i in range(args.streams)]
    gen = BatchGenerator(model, completion_batch_size=args.streams, prefill_batch_size=args.streams)
    uids = gen.insert(prompts, max_tokens=[args.tokens] * args.streams)
    cache = PromptCache(2 << 30)
    done = 0
    while done < len(uids):
        for r in gen.next_generated():
            if r.finish_reason is not None:
                done += 1
                cache.store(("m", str(r.uid)), r.all_tokens, r.prompt_cache)
    kv = cache.nbytes
    streams = f"{args.streams} streams x {args.tokens} tokens, their KV then cached ({kv / MIB:.1f} MiB)"
    ledger.stage(streams, mlx_state())
    gen.close()
    print(f"peak RSS (VmHWM) {status('VmHWM') / MIB:.1f} MiB; MLX buffer cache bound {mx.get_cache_memory() / MIB:.1f}")


if __name__ == "__main__":
    main()
