"""The MLX-free loading of mlx-lm's tool parsers agrees with mlx-lm itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import _infer_thinking, _infer_tool_parser

from harness.families import FAMILY_FORMAT, make_family_tokenizer
from lmspd.engine.upstream.parsers import infer_mlx_thinking, infer_mlx_tool_parser, parser_module
from lmspd.models.tokenizer import Tokenizer


class Probe:
    def __init__(self, tok: Tokenizer) -> None:
        self.chat_template = tok.chat_template
        self.vocab = tok.vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return []


@pytest.mark.parametrize("family", [*FAMILY_FORMAT, "smollm2"])
def test_inference_mirrors_mlx_lm(tmp_path: Path, smol_dir: Path, family: str) -> None:
    model_dir = smol_dir if family == "smollm2" else make_family_tokenizer(tmp_path, smol_dir, family)
    tok = Tokenizer(model_dir)
    probe = Probe(tok)
    assert infer_mlx_tool_parser(tok.chat_template, tok.vocab) == _infer_tool_parser(probe)
    start, end, _, _ = _infer_thinking(probe)
    assert infer_mlx_thinking(tok.vocab) == (None if start is None else (start, end))


def test_parsers_load_without_mlx() -> None:
    code = (
        "import sys\n"
        "from lmspd.engine.upstream.parsers import parser_module\n"
        "for name in ('json_tools', 'mistral', 'qwen3_coder', 'pythonic'):\n"
        "    parser_module(name).parse_tool_call\n"
        "assert 'mlx' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_a_loaded_parser_parses_like_the_original() -> None:
    from mlx_lm.tool_parsers import json_tools

    text = '{"name": "f", "arguments": {"a": [1, 2]}}'
    assert parser_module("json_tools").parse_tool_call(text) == json_tools.parse_tool_call(text)
