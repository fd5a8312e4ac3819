"""Weight dtype benchmark: prefill and decode tok/s of each choice, and whether it stays correct.

    python -m bench.weights [--model NAME]

For every dtype the model is loaded afresh, converted, and timed with raw
mlx-lm (greedy, a ~90-token prompt, 48 output tokens); it then answers
"What is the capital of France?" so a fast-but-wrong choice shows up. The last
line is what ``weight_dtype = "auto"`` picks on this backend. The BLAS is the
engine's (the system's OpenBLAS when there is one), loaded before MLX as the
engine loads it.
"""

from __future__ import annotations

import argparse

from lmspd.engine.upstream.blas import load as load_blas

BLAS = load_blas("auto")  # before MLX is imported, as in the engine

import mlx.core as mx  # noqa: E402
from mlx_lm import generate, load, stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from lmspd.config import load_config  # noqa: E402
from lmspd.engine.weights import apply_weight_dtype, choose, measure  # noqa: E402
from lmspd.models.registry import ModelRegistry  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    config = load_config()
    model = ModelRegistry(config).resolve(args.model or config.default_model)
    story = [{"role": "user", "content": "Write a long story about a dragon and a knight. " * 5}]
    france = [{"role": "user", "content": "What is the capital of France?"}]
    backend = "gpu" if mx.metal.is_available() else "cpu"
    print(f"model {model.name} | backend {backend} | BLAS {BLAS or 'bundled reference'}")
    print(f"{'weights':<18}{'prefill tok/s':>15}{'decode tok/s':>14}  answer")
    for dtype in ("quantized", "quantized_float32", "float32", "float16", "bfloat16"):
        raw, tok = load(str(model.path))
        apply_weight_dtype(raw, dtype)
        ids = tok.apply_chat_template(story, add_generation_prompt=True)
        list(stream_generate(raw, tok, ids[:8], max_tokens=2))  # warm-up
        last = list(stream_generate(raw, tok, ids, max_tokens=args.tokens, sampler=make_sampler(0.0)))[-1]
        answer = generate(
            raw,
            tok,
            tok.apply_chat_template(france, add_generation_prompt=True),
            max_tokens=12,
            sampler=make_sampler(0.0),
        )
        print(f"{dtype:<18}{last.prompt_tps:>15.1f}{last.generation_tps:>14.1f}  {answer!r}")
    raw, _ = load(str(model.path))
    scores = measure(raw)
    print("auto picks:", choose(scores), {k: f"{v * 1e3:.0f} ms/token" for k, v in scores.items()})


if __name__ == "__main__":
    main()
