"""The engine's memory, itemized: what each part of a loaded model and a batch of streams holds.

    python -m bench.memory [--model-dir DIR] [--weight-dtype auto] [--streams 8] [--tokens 32]

One process does what the engine process does, in order, and reads its resident memory
(``/proc/self/status``: VmRSS, and VmHWM for the peak) after each stage, beside MLX's own
accounting (active and cached buffers, its peak): Python and each import of the engine's
start (worker.main: lmspd's engine modules, BLAS, MLX, mlx-lm, the patches); the weights, loaded
and converted (against the bytes of the model's parameters), the tokenizer, each with its
transients then given back (the engine gives a load's back once it is done); then ``--streams``
streams decoding ``--tokens`` tokens each in one ``BatchGenerator`` (KV, transients), their KV
kept in the prompt cache as the engine keeps a finished request's, and the MLX buffer cache at
the engine's bound; last, what the engine builds on a request's demand: logprobs' spelling of
tokens, and a grammar's tokenizer. Resident memory counts pages touched, so each row is what
that stage added (docs/memory.md).
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
        self.row("Python (the interpreter, argparse)", self.last, "")

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

    # The engine's start, stage by stage, as worker.main does it (docs/memory.md).
    ledger = Ledger()
    import lmspd.engine.worker  # noqa: F401  # the engine's own modules, as spawn imports them

    ledger.stage("lmspd.engine.worker (msgspec, config, lmspd's engine)")
    from lmspd.engine.upstream.blas import load as load_blas

    blas = load_blas("auto")
    ledger.stage(f"BLAS ({Path(blas).name if blas else 'bundled'})")
    import mlx.core as mx

    ledger.stage("mlx.core")
    from lmspd.engine.upstream.lean import import_mlx_lm

    import_mlx_lm()
    ledger.stage("mlx-lm (numpy; no transformers, no huggingface_hub)")
    from lmspd.engine.upstream import batch_cache, prompt_batch
    from lmspd.engine.upstream.stepping import install as step_now

    step_now()
    batch_cache.install()
    prompt_batch.install()
    from lmspd.engine.prompt_cache import PromptCache

    ledger.stage("the upstream patches, the prompt cache")
    from mlx.utils import tree_flatten
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load_model

    from bench.step_profile import default_model_dir
    from lmspd.engine.constraint import Grammars
    from lmspd.engine.lifecycle import release_memory
    from lmspd.engine.loaded import BUFFER_CACHE_BYTES, bound_buffer_cache
    from lmspd.engine.logprobs import TokenPieces
    from lmspd.engine.packed import packed_matrix_bytes
    from lmspd.engine.weights import apply_weight_dtype
    from lmspd.models.tokenizer import Tokenizer

    model_dir = Path(args.model_dir or default_model_dir())
    bound_buffer_cache()
    ledger.stage("the bench's own (the default model's lookup)")
    model: Any
    model, _ = load_model(model_dir)
    dtype = apply_weight_dtype(model, args.weight_dtype)
    mx.eval(model.parameters())
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    ledger.stage(f"weights ({dtype}; parameters {params / MIB:.1f} MiB)", mlx_state())
    bound_buffer_cache(max(BUFFER_CACHE_BYTES, 2 * packed_matrix_bytes(model)))
    # The engine gives a load's transients back once, when the load is done
    # (Residency.release_freed); here after each part, so each part's are told apart.
    release_memory()
    ledger.stage("  the weights' transients given back (release_memory)")
    import tokenizers  # noqa: F401

    ledger.stage("the tokenizers library")
    tok = Tokenizer(model_dir)
    ledger.stage("the tokenizer (the engine's one copy)")
    release_memory()
    ledger.stage("  its transients given back (release_memory)")
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
    # What the engine builds only when a request asks (LoadedModel.token_pieces, grammar_set),
    # each measured with freed memory given back first, so a row is what the object keeps.
    release_memory()
    ledger.stage("freed memory given back (release_memory)")
    vocab = tok.vocab_size
    pieces = TokenPieces(tok)
    release_memory()
    ledger.stage("logprobs' spelling (TokenPieces, shared tokenizer)")
    for i in range(vocab):
        pieces.piece(i)
    release_memory()
    ledger.stage(f"  all {vocab} tokens spelled and kept")
    grammars = Grammars(model_dir, tok.eos_token_ids, vocab)
    release_memory()
    ledger.stage("a grammar's tokenizer (llguidance LLTokenizer)")
    del grammars
    print(f"peak RSS (VmHWM) {status('VmHWM') / MIB:.1f} MiB; MLX buffer cache bound {mx.get_cache_memory() / MIB:.1f}")


if __name__ == "__main__":
    main()
