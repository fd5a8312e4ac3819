"""Weight dtype: the dense float32 path computes what the quantized model computes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from service.engine import weights
from service.engine.weights import apply_weight_dtype, measure
from service.models.registry import ResolvedModel


def _greedy(model: object, n: int = 20) -> list[int]:
    prompt = mx.array([1, 9690, 198, 2683, 359, 253, 5356, 5646])
    steps = generate_step(prompt, model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in steps]


def test_float32_reproduces_quantized_tokens(tiny: ResolvedModel) -> None:
    quantized, _ = load_model(tiny.path)
    dense, _ = load_model(tiny.path)
    assert apply_weight_dtype(dense, "float32") == "float32"
    assert _greedy(dense) == _greedy(quantized)


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def test_measure_scores_only_exact_choices(tiny: ResolvedModel) -> None:
    # On a model this small the timings are microseconds and noisy: which candidates pass
    # the 1.5x decode cut varies from run to run (even "quantized" can be cut), and auto
    # measures afresh. What holds every time: the scores are non-empty timings of exact
    # choices only, and auto applies one of those.
    model, _ = load_model(tiny.path)
    scores = measure(model)
    assert scores and set(scores) <= {"quantized", "float32"}
    assert all(v > 0 for v in scores.values())
    choice = apply_weight_dtype(model, "auto")
    assert choice in ("quantized", "float32")
    assert _is_quantized(model) == (choice == "quantized")


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ({"quantized": 2e-3, "float32": 1e-3}, "float32"),
        ({"quantized": 1e-3, "float32": 2e-3}, "quantized"),
        ({"float32": 1e-3}, "float32"),
        ({"quantized": 1e-3}, "quantized"),
    ],
)
def test_auto_applies_the_fastest_measured_choice(
    tiny: ResolvedModel, monkeypatch: pytest.MonkeyPatch, scores: dict[str, float], expected: str
) -> None:
    monkeypatch.setattr(weights, "measure", lambda model: scores)
    model, _ = load_model(tiny.path)
    assert apply_weight_dtype(model, "auto") == expected
    assert _is_quantized(model) == (expected == "quantized")
    if expected == "float32":
        assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}


@pytest.mark.parametrize("dtype", ["quantized", "bfloat16"])
def test_explicit_choices_are_applied(tiny: ResolvedModel, dtype: str) -> None:
    model, _ = load_model(tiny.path)
    assert apply_weight_dtype(model, dtype) == dtype
    assert _greedy(model, 3)
