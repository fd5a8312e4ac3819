"""Weight dtype: the dense float32 path computes what the quantized model computes."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from lmspd.engine import kernels, packed, weights
from lmspd.engine.upstream import decode_block
from lmspd.engine.weights import apply_weight_dtype, measure
from lmspd.models.registry import ResolvedModel


def _greedy(model: object, n: int = 20) -> list[int]:
    prompt = mx.array([1, 9690, 198, 2683, 359, 253, 5356, 5646])
    steps = generate_step(prompt, model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in steps]


def test_float32_reproduces_quantized_tokens(tiny: ResolvedModel) -> None:
    quantized, _ = load_model(tiny.path)
    dense, _ = load_model(tiny.path)
    assert apply_weight_dtype(dense, "float32") == "float32"
    assert _greedy(dense) == _greedy(quantized)


def test_packed_float32_reproduces_quantized_tokens(tiny: ResolvedModel) -> None:
    quantized, _ = load_model(tiny.path)
    packed_model, _ = load_model(tiny.path)
    assert apply_weight_dtype(packed_model, "quantized_float32") == "quantized_float32"
    assert _greedy(packed_model) == _greedy(quantized)
    layers = [m for _, m in packed_model.named_modules() if isinstance(m, packed.PackedLinear)]
    assert layers and not _is_quantized(packed_model)  # every quantized layer runs packed
    # The weights stay packed (uint32); everything else runs in float32.
    dtypes = {v.dtype for _, v in tree_flatten(packed_model.parameters())}
    assert dtypes == {mx.uint32, mx.float32}


def test_packed_float32_decodes_a_batch_of_uneven_prompts_as_the_quantized_model(tiny: ResolvedModel) -> None:
    """Prompts of three lengths in one BatchGenerator: left padding gives each row its own rope
    offset (an array), which the packed model's table rope takes at decode."""
    from mlx_lm.generate import BatchGenerator

    prompts = [[(5 * i + j) % 700 + 3 for j in range(n)] for i, n in enumerate((3, 9, 14))]

    def tokens(model: nn.Module) -> dict[int, list[int]]:
        gen = BatchGenerator(model, completion_batch_size=3, prefill_batch_size=3)
        uids = gen.insert(prompts, max_tokens=[12] * 3)
        out: dict[int, list[int]] = {u: [] for u in uids}
        while any(len(v) < 12 for v in out.values()):
            for r in gen.next_generated():
                out[r.uid].append(r.token)
        gen.close()
        return out

    quantized, _ = load_model(tiny.path)
    packed_model, _ = load_model(tiny.path)
    apply_weight_dtype(packed_model, "quantized_float32")
    assert isinstance(packed_model.model.layers[0].self_attn.rope, packed.TableRoPE)
    assert isinstance(packed_model.model.layers[0].input_layernorm, packed.FusedRMSNorm)
    attention = packed_model.model.layers[0].self_attn
    assert attention.q_proj._siblings is attention.v_proj._siblings is not None  # one call for q, k, v
    assert tokens(packed_model) == tokens(quantized)


def test_a_decode_steps_attention_and_swiglu_are_lmspds_primitives_with_mlx_lms_bits(
    tiny: ResolvedModel, tmp_path: Path
) -> None:
    """A decode step's blocks run decode_block.DecodeBlock, their attention layers
    decode_block.DecodeBlockAttention (decode_block.h), the norms, residual adds and swiglu inside
    the products (their primitives are in the step's graph, no slice update, no Add or RmsNorm in
    a block), and the logits are those of the unfused kernels and of mlx-lm's own Attention,
    TransformerBlock and functions, bit for bit, across the KV cache growing at 256."""
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load_model(tiny.path)
    apply_weight_dtype(model, "quantized_float32")
    layers = [layer.self_attn for layer in model.model.layers]
    blocks = list(model.model.layers)
    assert all(type(a) is decode_block.DecodeBlockAttention for a in layers)
    assert all(type(b) is decode_block.DecodeBlock for b in blocks)
    # Each block's plan holds the very arrays its modules hold once loaded (install ran last).
    for b in blocks:
        attn, mlp, plan = b.self_attn, b.mlp, b._plan
        held = [attn.q_proj._siblings, attn.o_proj, mlp.gate_proj._siblings, mlp.down_proj]
        planned = [plan.qkv, plan.o_proj, plan.gate_up, plan.down_proj]
        assert plan.attn is attn and attn._rope.cos is attn.rope._cos
        assert plan.before is b.input_layernorm.weight and plan.after is b.post_attention_layernorm.weight
        for m, p in zip(held, planned, strict=True):
            assert p[0] is m.weight and p[1] is m.scales and p[2] is m.biases
    namespace = sys.modules[type(model.model.layers[0].mlp).__module__]
    names = ("scaled_dot_product_attention", "swiglu")
    ours = {name: getattr(namespace, name) for name in names}
    assert isinstance(ours["scaled_dot_product_attention"], packed.Attention)
    assert isinstance(ours["swiglu"], packed.SwiGLU)
    prompt = mx.array([[(7 * i) % 900 + 3 for i in range(250)]])

    def decode(functions: dict[str, object], kind: type, block: type, steps: int = 9) -> list[mx.array]:
        for name, function in functions.items():
            setattr(namespace, name, function)
        for a in layers:
            a.__class__ = kind
        for b in blocks:
            b.__class__ = block
        cache = make_prompt_cache(model)
        token = mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1)[:, None]
        out = []
        for _ in range(steps):  # positions 250 to 258: the cache grows from 256 to 512 on the way
            logits = model(token, cache=cache)[:, -1]
            mx.eval(logits)
            out.append(logits)
            token = mx.argmax(logits, axis=-1)[:, None]
        return out

    try:
        cache = make_prompt_cache(model)
        mx.eval(model(prompt[:, :20], cache=cache), [c.state for c in cache])  # the prompt's graph done
        mx.export_to_dot(str(tmp_path / "step.dot"), model(prompt[:, :1], cache=cache))
        graph = (tmp_path / "step.dot").read_text()
        assert "LmspdCacheWrite" in graph and "SliceUpdate" not in graph
        # Each block's attention through its second residual add: one decode_tail.
        assert graph.count('label ="LmspdDecodeTail"') == len(blocks) and "LmspdDecodeAttend" not in graph
        # In the blocks, no norm, add or swiglu of their own: the model's final norm, and the one
        # Add of the embedding row's dequantization (scale * q + bias).
        assert graph.count('label ="LmspdRmsNorm"') == 1 and graph.count('label ="Add"') == 1
        assert "LmspdSwiGLU" not in graph
        got = decode(ours, decode_block.DecodeBlockAttention, decode_block.DecodeBlock)
        unfused = decode(ours, decode_block.DecodeBlockAttention, llama.TransformerBlock)
        want = decode(
            {name: function.original for name, function in ours.items()}, llama.Attention, llama.TransformerBlock
        )
    finally:
        for name, function in ours.items():
            setattr(namespace, name, function)
        for a in layers:
            a.__class__ = decode_block.DecodeBlockAttention
        for b in blocks:
            b.__class__ = decode_block.DecodeBlock
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))
    assert all(mx.array_equal(g, w).item() for g, w in zip(unfused, want, strict=True))


def test_a_batchs_decode_steps_through_the_fused_blocks_keep_their_bits(tiny: ResolvedModel) -> None:
    """mlx-lm's BatchGenerator (a BatchKVCache, left padding, sequences joining and leaving)
    with decode_block.DecodeBlock and with mlx-lm's own TransformerBlock over the same kernels:
    the same tokens and logprobs, bit for bit."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models import llama

    model, _ = load_model(tiny.path)
    apply_weight_dtype(model, "quantized_float32")
    blocks = list(model.model.layers)
    prompts = [[(5 * i + j) % 700 + 3 for j in range(n)] for i, n in enumerate((3, 9, 14, 30))]

    def run(block: type) -> list[tuple[int, int, mx.array]]:
        for b in blocks:
            b.__class__ = block
        gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=2)
        gen.insert(prompts, max_tokens=[6, 12, 9, 12])
        out: list[tuple[int, int, mx.array]] = []
        while len(out) < 39:
            out += [(r.uid, r.token, r.logprobs) for r in gen.next_generated()]
        gen.close()
        return out

    try:
        got = run(decode_block.DecodeBlock)
        want = run(llama.TransformerBlock)
    finally:
        for b in blocks:
            b.__class__ = decode_block.DecodeBlock
    assert [(u, t) for u, t, _ in got] == [(u, t) for u, t, _ in want]
    assert all(mx.array_equal(g, w).item() for (_, _, g), (_, _, w) in zip(got, want, strict=True))


def test_sampling_normalizes_through_the_kernel_with_mlxs_bits(tiny: ResolvedModel) -> None:
    """mlx-lm's batches normalize each step's logits through lmspd's logsumexp
    (upstream/logsumexp.py): the same tokens and logprobs, bit for bit, as with mlx.core's."""
    from mlx_lm.generate import BatchGenerator

    from lmspd.engine.upstream import logsumexp

    model, _ = load_model(tiny.path)
    apply_weight_dtype(model, "quantized_float32")
    assert isinstance(logsumexp.generate.mx, logsumexp.KernelMx)
    prompts = [[(5 * i + j) % 700 + 3 for j in range(n)] for i, n in enumerate((3, 9, 14))]

    def run() -> list[tuple[int, int, mx.array]]:
        gen = BatchGenerator(model, completion_batch_size=3, prefill_batch_size=3)
        gen.insert(prompts, max_tokens=[8] * 3)
        out: list[tuple[int, int, mx.array]] = []
        while len(out) < 24:
            out += [(r.uid, r.token, r.logprobs) for r in gen.next_generated()]
        gen.close()
        return out

    kernel_mx = logsumexp.generate.mx
    try:
        got = run()
        logsumexp.generate.mx = mx
        want = run()
    finally:
        logsumexp.generate.mx = kernel_mx
    assert [(u, t) for u, t, _ in got] == [(u, t) for u, t, _ in want]
    assert all(mx.array_equal(g, w).item() for (_, _, g), (_, _, w) in zip(got, want, strict=True))


def test_packed_float32_prefills_through_the_dense_product(tiny: ResolvedModel) -> None:
    """A prompt longer than the matvec's rows takes the dequantize + BLAS path; both paths
    agree with the quantized model's greedy answer."""
    quantized, _ = load_model(tiny.path)
    packed_model, _ = load_model(tiny.path)
    apply_weight_dtype(packed_model, "quantized_float32")
    prompt = mx.array([(7 * i) % 900 + 3 for i in range(3 * packed.KERNEL_ROWS)])
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    want = [int(t) for t, _ in generate_step(prompt, quantized, max_tokens=8, sampler=greedy)]
    assert [int(t) for t, _ in generate_step(prompt, packed_model, max_tokens=8, sampler=greedy)] == want


def test_packed_float32_refuses_a_quantization_it_cannot_run(tiny: ResolvedModel) -> None:
    model, _ = load_model(tiny.path)
    layer = model.model.layers[0].mlp.up_proj
    layer.bits = 3
    assert packed.unsupported(model) == "model.layers.0.mlp.up_proj has 3-bit groups of 32"
    with pytest.raises(kernels.KernelUnavailable, match="3-bit"):
        apply_weight_dtype(model, "quantized_float32")


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def test_measure_scores_only_exact_choices(tiny: ResolvedModel) -> None:
    # On a model this small the timings are microseconds and noisy: which candidates pass
    # the 1.5x decode cut varies from run to run (even "quantized" can be cut), and auto
    # measures afresh. What holds every time: the scores are non-empty timings of exact
    # choices only, and auto applies one of those.
    model, _ = load_model(tiny.path)
    scores = measure(model)
    assert scores and set(scores) <= {"quantized", "float32", "quantized_float32"}
    assert all(v > 0 for v in scores.values())
    choice = apply_weight_dtype(model, "auto")
    assert choice in ("quantized", "float32", "quantized_float32")
    assert _is_quantized(model) == (choice == "quantized")


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ({"quantized": 2e-3, "float32": 1e-3}, "float32"),
        ({"quantized": 1e-3, "float32": 2e-3}, "quantized"),
        ({"float32": 1e-3}, "float32"),
        ({"quantized": 1e-3}, "quantized"),
        # A packed choice within 10% of the fastest is kept for its memory.
        ({"float32": 1.00e-3, "quantized_float32": 1.05e-3}, "quantized_float32"),
        ({"float32": 1.00e-3, "quantized_float32": 1.20e-3}, "float32"),
        ({"float32": 1.0e-3, "quantized_float32": 0.5e-3, "quantized": 0.52e-3}, "quantized_float32"),
    ],
)
def test_auto_applies_the_fastest_measured_choice(
    tiny: ResolvedModel, monkeypatch: pytest.MonkeyPatch, scores: dict[str, float], expected: str
) -> None:
    monkeypatch.setattr(weights, "measure", lambda model, kernel_dir: scores)
    monkeypatch.setattr(weights, "fixed_choice", lambda model, kernel_dir: None)  # where kernels do not run
    model, _ = load_model(tiny.path)
    assert apply_weight_dtype(model, "auto") == expected
    assert _is_quantized(model) == (expected == "quantized")
    if expected == "float32":
        assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}


def test_auto_takes_the_packed_kernels_wherever_they_run_without_timing(
    tiny: ResolvedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule, not a timing: a busy machine cannot flip auto to float32 on one start in three."""

    def no_timing(model: object, kernel_dir: str) -> dict[str, float]:
        raise AssertionError("auto timed its candidates")

    monkeypatch.setattr(weights, "measure", no_timing)
    for _ in range(3):
        model, _ = load_model(tiny.path)
        assert apply_weight_dtype(model, "auto") == "quantized_float32"
    model, _ = load_model(tiny.path)
    model.model.layers[0].mlp.up_proj.bits = 3  # a quantization the kernels cannot run: measured
    assert weights.fixed_choice(model, "") is None


@pytest.mark.parametrize("dtype", ["quantized", "bfloat16"])
def test_explicit_choices_are_applied(tiny: ResolvedModel, dtype: str) -> None:
    model, _ = load_model(tiny.path)
    assert apply_weight_dtype(model, dtype) == dtype
    assert _greedy(model, 3)
