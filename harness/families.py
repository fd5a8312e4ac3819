"""Tokenizer directories for the tool-calling template families, built on SmolLM2's tokenizer.

Each family gets its real marker tokens (added as special tokens, after the base
vocabulary, which stays intact so random tiny weights can be sized to it) and a
chat template in the style of the family's own: tools in the prompt, assistant
tool calls in the family's call syntax, tool results, a system prompt, and the
generation prompt at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILY_FORMAT = {
    "hermes_think": "json_tools",
    "mistral": "mistral",
    "llama3": "llama3_json",
    "qwen3_coder": "qwen3_coder",
}

# The arguments of an assistant tool call as the template writes them: as given when already a JSON string.
_ARGUMENTS = (
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
)
_UNWRAP = "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"

_HERMES_THINK = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    + _UNWRAP
    + '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    + _ARGUMENTS
    + "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    # Qwen3's switch: with enable_thinking false the block comes pre-closed.
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_MISTRAL = (
    "{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.last %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' }}{%- if system_message is defined and loop.last %}{{- system_message + '\\n\\n' }}{%- endif %}"
    "{{- message.content + '[/INST]' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    + _UNWRAP
    + "{{- '[TOOL_CALLS]' + tool_call.name + '[ARGS]' }}"
    + _ARGUMENTS
    + "{%- endfor %}{{- eos_token }}"
    "{%- elif message.role == 'tool' %}{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}"
    "{%- endif %}{%- endfor %}"
)

_LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system_message = '' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n\\n' + system_message }}"
    "{%- if tools %}{{- '\\n\\nGiven the following functions, please respond with a JSON for a function call '"
    "'with its proper arguments that best answers the given prompt.\\n\\nRespond in the format "
    '{\\"name\\": function name, \\"parameters\\": dictionary of argument name and its value}. '
    "Do not use variables.' }}"
    "{%- for tool in tools %}{{- '\\n\\n' }}{{- tool | tojson }}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for tool_call in message.tool_calls %}" + _UNWRAP + "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}' + _ARGUMENTS + "{{- '}' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_QWEN3_CODER = (
    "{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system_message = 'You are a helpful assistant.' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system_message }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{%- if tool.function %}{%- set tool = tool.function %}{%- endif %}"
    "{{- '\\n<function>\\n<name>' + tool.name + '</name>' }}"
    "{%- if tool.description %}{{- '\\n<description>' + tool.description + '</description>' }}{%- endif %}"
    "{{- '\\n<parameters>' }}"
    "{%- for name, schema in ((tool.parameters or {}).properties or {}).items() %}"
    "{{- '\\n<parameter>\\n<name>' + name + '</name>\\n<type>' + (schema.type or 'string') }}"
    "{{- '</type>\\n</parameter>' }}"
    "{%- endfor %}{{- '\\n</parameters>\\n</function>' }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "</function>\\n</tool_call>' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    + _UNWRAP
    + "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- if tool_call.arguments is mapping %}{%- for name, value in tool_call.arguments.items() %}"
    "{{- '<parameter=' + name + '>\\n' }}"
    "{%- if value is string %}{{- value }}{%- else %}{{- value | tojson }}{%- endif %}"
    "{{- '\\n</parameter>\\n' }}{%- endfor %}{%- endif %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop_messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop_messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# family: (added special tokens, chat template, bos token, eos token)
_FAMILIES: dict[str, tuple[list[str], str, str, str]] = {
    "hermes_think": (
        ["<tool_call>", "</tool_call>", "<think>", "</think>"],
        _HERMES_THINK,
        "<|im_start|>",
        "<|im_end|>",
    ),
    "mistral": (
        [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        _MISTRAL,
        "<s>",
        "</s>",
    ),
    "llama3": (
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        _LLAMA3,
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "qwen3_coder": (["<tool_call>", "</tool_call>"], _QWEN3_CODER, "<|im_start|>", "<|im_end|>"),
}


def make_family_tokenizer(out: Path, smol_dir: Path, family: str) -> Path:
    """Write ``family``'s tokenizer.json and tokenizer_config.json into ``out`` and return it."""
    from tokenizers import AddedToken, Tokenizer

    added, template, bos, eos = _FAMILIES[family]
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = json.loads((smol_dir / "tokenizer_config.json").read_text())
    decoder = config.setdefault("added_tokens_decoder", {})
    for token in added:
        token_id = tok.token_to_id(token)
        decoder[str(token_id)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    config.update(chat_template=template, bos_token=bos, eos_token=eos, pad_token=eos)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return out


def _swap_rows(path: Path, a: int, b: int) -> None:
    """Swap two tokens' rows of a tied, row-quantized embedding: exactly, the model then
    says ``b`` wherever it said ``a`` and goes on as before (and the other way round)."""
    import mlx.core as mx

    loaded = mx.load(str(path / "model.safetensors"))
    assert isinstance(loaded, dict)
    weights: dict[str, mx.array] = loaded
    for name in ("weight", "scales", "biases"):
        key = f"model.embed_tokens.{name}"
        order = mx.arange(weights[key].shape[0])
        order[a], order[b] = b, a
        weights[key] = weights[key][order]
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def make_thinker(out: Path, smol_dir: Path, prompt: str, steps: int = 2, lookahead: int = 8) -> Path:
    """A tiny hermes_think model whose greedy answer to ``prompt`` reasons for ``steps``
    tokens, closes ``</think>`` and goes on with a message.

    Random weights never close a reasoning block on their own, so the model's greedy
    answer is computed once, and the embedding rows of its token at ``steps`` and
    ``</think>`` are swapped: it then says what it said before, ``</think>`` in that
    token's place."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from harness.models import make_tiny_model
    from lmspd.models.tokenizer import Tokenizer
    from lmspd.prompting.prompt import build_prompt
    from lmspd.responses.schema import ResponseRequest

    path = make_tiny_model(out, make_family_tokenizer(out.with_name(out.name + "-tok"), smol_dir, "hermes_think"))
    tok = Tokenizer(path)
    ids = tok.encode(build_prompt(tok, ResponseRequest(input=prompt), []).text)
    model, _ = load_model(path)
    cache, step, said = make_prompt_cache(model), ids, []
    for _ in range(lookahead):
        said.append(int(mx.argmax(model(mx.array([step]), cache=cache)[0, -1]).item()))  # type: ignore[arg-type]
        step = said[-1:]
    end, swap = tok.vocab["</think>"], said[steps]
    assert swap not in ids and said.count(swap) == 1 and end not in said, said
    _swap_rows(path, swap, end)
    return path
