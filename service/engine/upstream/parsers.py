"""mlx-lm's tool-call parsers and its format inference, without importing MLX.

``mlx_lm.tool_parsers.<format>`` modules are plain Python, but importing them runs
``mlx_lm/__init__`` (MLX, transformers: seconds and hundreds of MB) in the server
process, which otherwise never loads MLX. So each parser file is loaded on its own,
and the inference helpers from ``mlx_lm.tokenizer_utils`` (a module that imports
transformers) are mirrored here; a test checks the mirror against the original.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import ModuleType

# The order matters: mlx-lm tests the more specific markers first (mlx-lm 0.32).
_TEMPLATE_FORMATS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<minimax:tool_call>",), "minimax_m2"),
    (("<|tool_call>", "<tool_call|>"), "gemma4"),
    (("<start_function_call>",), "function_gemma"),
    (("<longcat_tool_call>",), "longcat"),
    (("<arg_key>",), "glm47"),
)
_THINK_PAIRS = (("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"), ("<|think:start|>", "<|think:end|>"))
_XTML = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


def _package_dir() -> Path:
    spec = importlib.util.find_spec("mlx_lm")  # finds the package without running it
    assert spec is not None and spec.submodule_search_locations is not None, "mlx-lm is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def parser_module(name: str) -> ModuleType:
    """``mlx_lm.tool_parsers.<name>``, loaded from its file alone when it imports nothing
    from its package (all but a few do), else imported normally."""
    path = _package_dir() / "tool_parsers" / f"{name}.py"
    if not path.is_file():
        raise ValueError(f"mlx-lm has no tool parser {name!r}")
    source = path.read_text()
    if "from ." in source or "import mlx" in source or "from mlx" in source:
        return importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    spec = importlib.util.spec_from_file_location(f"lmspd_mlx_tool_parsers.{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def infer_mlx_tool_parser(chat_template: str | None, vocab: Mapping[str, int]) -> str | None:
    """Mirror of ``mlx_lm.tokenizer_utils._infer_tool_parser``."""
    t = chat_template
    if isinstance(t, str):
        for markers, name in _TEMPLATE_FORMATS:
            if all(m in t for m in markers):
                return name
        if "<|tool_list_start|>" in t or "<|tool_call_start|>" in t:
            return "pythonic"
        if "<tool_call>\\n<function=" in t or "<tool_call>\n<function=" in t:
            return "qwen3_coder"
        if "<|tool_calls_section_begin|>" in t:
            return "kimi_k2"
        if '<function name="' in t and '<param name="' in t:
            return "minicpm5"
        if "[TOOL_CALLS]" in t:
            return "mistral"
        if "<atem:function_calls>" in t:
            return "muse_spark"
        if "<tool_call>" in t and "tool_call.name" in t:
            return "json_tools"
    if all(m in vocab for m in _XTML):
        return "kimi_k3"
    if "<|tool_call_start|>" in vocab and "<|tool_call_end|>" in vocab:
        return "pythonic"
    return None


def infer_mlx_thinking(vocab: Mapping[str, int]) -> tuple[str, str] | None:
    """Mirror of ``mlx_lm.tokenizer_utils._infer_thinking`` (the marker strings only)."""
    for start, end in _THINK_PAIRS:
        if start in vocab and end in vocab:
            return start, end
    if "<|channel>" in vocab and "<channel|>" in vocab:
        return "<|channel>thought", "<channel|>"
    if all(m in vocab for m in _XTML):
        return "<|open|>think<|sep|>", "<|close|>think<|sep|>"
    return None
