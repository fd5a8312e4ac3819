"""Weight dtype: the dense float32 path computes what the quantized model computes."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from service.engine.weights import apply_weight_dtype, measure
from service.models.registry import ResolvedModel


def _greedy(model: object, n: int = 20) -> list[int]:
    prompt = mx.array([1, 9690, 198, 2683, 359, 253, 5356, 5646])
    steps = generate_step(prompt, model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))  # type: ignore[arg-type]
    return [int(t) for t, _ in steps]


def test_float32_reproduces_quantized_tokens(tiny: ResolvedModel) -> None:
    quantized, _ = load_model(tiny.path)
    dense, _ = load_model(tiny.path)
    assert apply_weight_dtype(dense, "float32") == "float32"
    assert _greedy(dense) == _greedy(quantized)


def test_auto_picks_a_measured_exact_choice(tiny: ResolvedModel) -> None:
    model, _ = load_model(tiny.path)
    scores = measure(model)
    assert "quantized" in scores and all(v > 0 for v in scores.values())
    assert set(scores) <= {"quantized", "float32"}
    choice = apply_weight_dtype(model, "auto")
    assert choice in scores


@pytest.mark.parametrize("dtype", ["quantized", "bfloat16"])
def test_explicit_choices_are_applied(tiny: ResolvedModel, dtype: str) -> None:
    model, _ = load_model(tiny.path)
    assert apply_weight_dtype(model, dtype) == dtype
    assert _greedy(model, 3)
