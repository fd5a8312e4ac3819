"""A decode step with each form a packed Llama block has taken, alternating step by step.

    python -m bench.block_ab [--model-dir DIR] [--steps 150] [--batch 1 4 8]

One mlx-lm ``BatchGenerator`` on the bundled model (the engine's weights and stepping, a
100-token prompt per row) steps while every block's class switches between:

- ``looked up``: seven primitives a block, and every array and child the step reads looked up
  through ``nn.Module.__getattr__`` each step (the block before issue 24's sixth pass);
- ``seven``: seven primitives a block, what the step reads gathered once (``_Plan``);
- ``tail``: four primitives a block, the attention through down in one ``decode_tail`` (now).

The first two are kept here, in the bench, only to be measured against; the same tokens come
out of all three (tests/engine/test_weights.py holds the engine's to mlx-lm's bits). Medians of
the steps each form ran; docs/benchmarks.md, "Sixth pass".
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.step_profile import default_model_dir


def forms() -> dict[str, type]:
    """The three forms, by name (defined here: importing lmspd's blocks imports MLX, which must
    come after the BLAS is loaded)."""
    import mlx.core as mx

    from lmspd.engine.upstream import decode_block

    class Seven(decode_block.DecodeBlock):
        """The block in seven primitives: decode_attend and the three products on their own."""

        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            plan = self._plan
            attn = plan.attn
            inputs = attn._block_inputs(x, mask, cache) if self._fusable(x, plan) else None
            if inputs is None:
                return super(decode_block.DecodeBlock, self).__call__(x, mask=mask, cache=cache)  # type: ignore[no-any-return]
            ext = attn._kernels
            q, k, v = ext.quantized_matvecs(x, *plan.qkv, plan.qkv_widths, norm=plan.before, eps=plan.before_eps)
            h = ext.quantized_matvec(attn.attend(q, k, v, inputs, cache), *plan.o_proj, residual=x)
            gate, up = ext.quantized_matvecs(h, *plan.gate_up, plan.gate_up_widths, norm=plan.after, eps=plan.after_eps)
            return ext.quantized_matvec(gate, *plan.down_proj, up=up, residual=h)  # type: ignore[no-any-return]

    class LookedUp(decode_block.DecodeBlock):
        """Seven primitives, and the modules' arrays and children looked up every step."""

        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            attn, mlp = self.self_attn, self.mlp
            fusable = (
                type(attn) is decode_block.DecodeBlockAttention
                and x.dtype == mx.float32
                and x.ndim == 3
                and x.shape[1] == 1
                and x.shape[0] <= min(attn.o_proj._kernel_rows, mlp.down_proj._kernel_rows)
            )
            inputs = attn._block_inputs(x, mask, cache) if fusable else None
            if inputs is None:
                return super(decode_block.DecodeBlock, self).__call__(x, mask=mask, cache=cache)  # type: ignore[no-any-return]
            ext, packed = attn._kernels, decode_block._packed
            qkv, gate_up = attn.q_proj._siblings, mlp.gate_proj._siblings
            before, after = self.input_layernorm, self.post_attention_layernorm
            q, k, v = ext.quantized_matvecs(x, *packed(qkv), qkv.widths, norm=before.weight, eps=before.eps)
            h = ext.quantized_matvec(attn.attend(q, k, v, inputs, cache), *packed(attn.o_proj), residual=x)
            gate, up = ext.quantized_matvecs(h, *packed(gate_up), gate_up.widths, norm=after.weight, eps=after.eps)
            return ext.quantized_matvec(gate, *packed(mlp.down_proj), up=up, residual=h)  # type: ignore[no-any-return]

    return {"looked up": LookedUp, "seven": Seven, "tail": decode_block.DecodeBlock}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=150, help="steps each form runs, per batch size")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()

    from lmspd.engine.upstream.blas import load as load_blas

    load_blas("auto")  # before MLX is imported, as the engine does
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load_model

    from lmspd.engine.loaded import bound_buffer_cache
    from lmspd.engine.upstream import decode_block, stepping
    from lmspd.engine.weights import apply_weight_dtype

    stepping.install()
    model, _ = load_model(Path(args.model_dir or default_model_dir()))
    apply_weight_dtype(model, "quantized_float32")
    bound_buffer_cache()
    mx.eval(model.parameters())
    blocks = list(model.model.layers)
    if not all(type(b) is decode_block.DecodeBlock for b in blocks):
        raise SystemExit("this model's blocks do not take lmspd's decode block")
    by_name = forms()
    order = list(by_name.items())
    for batch in args.batch:
        gen = BatchGenerator(model, completion_batch_size=batch, prefill_batch_size=batch, prefill_step_size=512)
        gen.insert([[(7 * i + j) % 900 + 3 for j in range(100)] for i in range(batch)], max_tokens=[10_000] * batch)
        while not gen.next()[1]:
            pass  # the prompts' prefill
        times: dict[str, list[float]] = {name: [] for name in by_name}
        try:
            for step in range(args.steps):
                for name, form in order[step % len(order) :] + order[: step % len(order)]:
                    for b in blocks:
                        b.__class__ = form
                    start = time.perf_counter()
                    gen.next()
                    times[name].append(time.perf_counter() - start)
        finally:
            for b in blocks:
                b.__class__ = decode_block.DecodeBlock
            gen.close()
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        now = ms["tail"]
        sides = ", ".join(f"{name} {v:.2f} ms ({v / now:.3f}x tail's time)" for name, v in ms.items())
        print(f"batch {batch}: {sides}", flush=True)


if __name__ == "__main__":
    main()
