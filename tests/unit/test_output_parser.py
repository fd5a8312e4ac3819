"""The output parser on text tokenized by each family's tokenizer and decoded token by token, as the server does."""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from harness.families import FAMILY_FORMAT, make_family_tokenizer
from lmspd.responses.parsing.call_formats import chat_tools
from lmspd.responses.parsing.output_parser import (
    ArgumentsDelta,
    CallDone,
    CallStarted,
    OutputParser,
    Piece,
    ReasoningDelta,
    TextDelta,
    infer_tool_format,
    think_markers,
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "opts": {"type": "object"},
            },
        },
    },
    {
        "type": "function",
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
]
WEATHER = {"city": 'Pa}ris "15e" ✓ 東京', "opts": {"unit": "°C", "hours": [1, {"deep": "}{"}]}}
TIME = {"zone": "UTC"}
QWEN_WEATHER = {"city": 'São Paulo "}"\nline 2', "days": 3, "metric": False, "opts": {"unit": "C", "hours": [1, 2]}}


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def hermes(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {dumps(args)}}}\n</tool_call>'


def qwen(name: str, args: dict[str, Any]) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else dumps(v)}\n</parameter>\n" for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


# family -> samples of (output text, parser kwargs, expected reasoning, expected text, expected calls)
Sample = tuple[str, dict[str, Any], str, str, list[tuple[str, dict[str, Any]]]]
SAMPLES: dict[str, list[Sample]] = {
    "hermes_think": [
        (
            "The user wants the weather.\n</think>\n\nLet me check.\n" + hermes("get_weather", WEATHER),
            {"reasoning": True},
            "The user wants the weather.\n",
            "Let me check.",
            [("get_weather", WEATHER)],
        ),
        (
            "</think>\n\n" + hermes("get_weather", WEATHER) + "\n" + hermes("get_time", TIME) + "\nBoth asked.",
            {"reasoning": True},
            "",
            "Both asked.",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        (
            "Short.</think>\n\nJust text, <b>no</b> call.",
            {"reasoning": True},
            "Short.",
            "Just text, <b>no</b> call.",
            [],
        ),
    ],
    "mistral": [
        (
            "Sure.[TOOL_CALLS]get_weather[ARGS]" + dumps(WEATHER) + "[TOOL_CALLS]get_time[ARGS]" + dumps(TIME),
            {},
            "",
            "Sure.",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": '
            + dumps(WEATHER)
            + '}, {"name": "get_time", "arguments": '
            + dumps(TIME)
            + "}]",
            {},
            "",
            "",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        ("[1] is a list, [TOOLS] is not a marker.", {}, "", "[1] is a list, [TOOLS] is not a marker.", []),
    ],
    "llama3": [
        ('{"name": "get_weather", "parameters": ' + dumps(WEATHER) + "}", {}, "", "", [("get_weather", WEATHER)]),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": '
            + dumps(WEATHER)
            + '}; {"name": "get_time", "parameters": '
            + dumps(TIME)
            + "}\nThat is all.",
            {},
            "",
            "That is all.",
            [("get_weather", WEATHER), ("get_time", TIME)],
        ),
        ('{"city": "Paris"} is JSON, not a call.', {}, "", '{"city": "Paris"} is JSON, not a call.', []),
        ("  Hello {there}", {}, "", "  Hello {there}", []),
    ],
    "qwen3_coder": [
        (
            "Let me look.\n" + qwen("get_weather", QWEN_WEATHER) + "\n" + qwen("get_time", TIME) + "\nDone.",
            {},
            "",
            "Let me look.Done.",
            [("get_weather", QWEN_WEATHER), ("get_time", TIME)],
        ),
        (
            qwen("get_time", {"zone": "null"}) + qwen("get_weather", {"city": "nullify", "days": 7}),
            {},
            "",
            "",
            [("get_time", {"zone": None}), ("get_weather", {"city": "nullify", "days": 7})],
        ),
    ],
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, smol_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_family_tokenizer(root / family, smol_dir, family) for family in FAMILY_FORMAT}


@pytest.fixture(scope="module")
def tokenizers(family_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {family: Tokenizer.from_file(str(path / "tokenizer.json")) for family, path in family_dirs.items()}


def token_deltas(tok: Tokenizer, text: str) -> list[str]:
    """The text as the server sees it: one delta per token, held while a character is incomplete."""
    ids = tok.encode(text, add_special_tokens=False).ids
    deltas, shown = [], ""
    for i in range(len(ids)):
        decoded = tok.decode(ids[: i + 1], skip_special_tokens=False)
        if decoded.endswith("\ufffd"):
            deltas.append("")
            continue
        deltas.append(decoded[len(shown) :])
        shown = decoded
    assert shown == text
    return deltas


def run(chunks: Iterable[str], **kwargs: Any) -> list[Piece]:
    parser = OutputParser(**kwargs)
    pieces = [piece for chunk in chunks for piece in parser.feed(chunk)]
    return pieces + parser.finish()


def merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent deltas of one kind joined: how the pieces were cut depends on the chunks, nothing else may."""
    out: list[Piece] = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + piece.text)
        elif isinstance(piece, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + piece.text)
        elif isinstance(piece, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == piece.index:
            out[-1] = ArgumentsDelta(piece.index, last.delta + piece.delta)
        else:
            out.append(piece)
    return out


def summary(pieces: list[Piece]) -> tuple[str, str, list[CallDone], dict[int, str]]:
    text = "".join(p.text for p in pieces if isinstance(p, TextDelta))
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
    streamed: dict[int, str] = {}
    for p in pieces:
        if isinstance(p, ArgumentsDelta):
            streamed[p.index] = streamed.get(p.index, "") + p.delta
    return reasoning, text, [p for p in pieces if isinstance(p, CallDone)], streamed


def parser_kwargs(family: str, extra: dict[str, Any]) -> dict[str, Any]:
    think = ("<think>", "</think>") if family == "hermes_think" else None
    return {"tool_format": FAMILY_FORMAT[family], "tools": TOOLS, "think": think, **extra}


def state(parser: OutputParser) -> tuple[Any, ...]:
    return parser._buf, parser._mode, parser._count, "".join(parser._raw), type(parser._scanner)


CASES = [(family, i) for family, samples in SAMPLES.items() for i in range(len(samples))]


@pytest.mark.parametrize(("family", "i"), CASES, ids=[f"{f}-{i}" for f, i in CASES])
def test_family_samples(tokenizers: dict[str, Tokenizer], family: str, i: int) -> None:
    text, extra, reasoning, message, calls = SAMPLES[family][i]
    kwargs = parser_kwargs(family, extra)
    deltas = token_deltas(tokenizers[family], text)
    pieces = run(deltas, **kwargs)
    assert merged(pieces) == merged(run([text], **kwargs)) == merged(run(text, **kwargs))
    got_reasoning, got_text, done, streamed = summary(pieces)
    assert (got_reasoning, got_text) == (reasoning, message)
    assert [p.index for p in pieces if isinstance(p, CallStarted)] == list(range(len(calls)))
    assert [(p.index, p.name, p.valid) for p in done] == [(n, name, True) for n, (name, _) in enumerate(calls)]
    for call, (_, args) in zip(done, calls, strict=True):
        assert streamed[call.index] == call.arguments == dumps(args)
        assert json.loads(call.arguments) == args
    # Each call's pieces come in order: started, its arguments, done.
    order = [(type(p).__name__, getattr(p, "index", None)) for p in merged(pieces) if not isinstance(p, TextDelta)]
    expected = [(kind, n) for n in range(len(calls)) for kind in ("CallStarted", "ArgumentsDelta", "CallDone")]
    assert [o for o in order if o[0] != "ReasoningDelta"] == expected


@pytest.mark.parametrize(("family", "i"), CASES, ids=[f"{f}-{i}" for f, i in CASES])
def test_rebuilt_parser_continues(tokenizers: dict[str, Tokenizer], family: str, i: int) -> None:
    text, extra, *_ = SAMPLES[family][i]
    kwargs = parser_kwargs(family, extra)
    deltas = token_deltas(tokenizers[family], text)
    for cut in range(0, len(deltas) + 1, max(1, len(deltas) // 7)):
        per_token, rebuilt = OutputParser(**kwargs), OutputParser(**kwargs)
        before = [p for d in deltas[:cut] for p in per_token.feed(d)]
        before_whole = rebuilt.feed("".join(deltas[:cut]))
        assert summary(before)[:2] == summary(before_whole)[:2]
        assert state(per_token) == state(rebuilt)
        rest = [p for d in deltas[cut:] for p in per_token.feed(d)] + per_token.finish()
        rest_rebuilt = [p for d in deltas[cut:] for p in rebuilt.feed(d)] + rebuilt.finish()
        assert merged(rest) == merged(rest_rebuilt)


@pytest.mark.parametrize("family", list(FAMILY_FORMAT))
def test_generation_cut_anywhere(family: str) -> None:
    """Ending at any point gives the same pieces however the text came, and a valid call's stream is its arguments."""
    rng = random.Random(family)
    for text, extra, *_ in SAMPLES[family]:
        kwargs = parser_kwargs(family, extra)
        for cut in range(0, len(text) + 1, 3):
            prefix = text[:cut]
            whole = merged(run([prefix], **kwargs))
            bounds = sorted(rng.sample(range(1, cut), min(cut - 1, cut // 3))) if cut > 1 else []
            chunks = [prefix[a:b] for a, b in zip([0, *bounds], [*bounds, cut], strict=True)]
            assert merged(run(chunks, **kwargs)) == whole, (prefix, chunks)
            _, _, done, streamed = summary(whole)
            assert all(streamed.get(d.index, "") == d.arguments for d in done), prefix


def test_qwen3_coder_matches_mlx_parser() -> None:
    module = importlib.import_module("mlx_lm.tool_parsers.qwen3_coder")
    body = qwen("get_weather", QWEN_WEATHER).removeprefix("<tool_call>").removesuffix("</tool_call>")
    expected = module.parse_tool_call(body, chat_tools(TOOLS))
    pieces = run(qwen("get_weather", QWEN_WEATHER), tool_format="qwen3_coder", tools=TOOLS)
    assert summary(pieces)[2] == [CallDone(0, "get_weather", dumps(expected["arguments"]), True)]


def test_arguments_stream_before_the_call_ends() -> None:
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    parser = OutputParser(tool_format="json_tools", tools=TOOLS)
    # Held: the start of a marker, and the whitespace that separates text from a call.
    assert parser.feed("Hi <tool") == [TextDelta("Hi")]
    assert merged(parser.feed(head.removeprefix("<tool"))) == [
        CallStarted(0, "get_weather"),
        ArgumentsDelta(0, '{"city": "Par'),
    ]
    assert merged(parser.feed('is"}}\n</tool_call>')) == [
        ArgumentsDelta(0, 'is"}'),
        CallDone(0, "get_weather", '{"city": "Paris"}', True),
    ]

    parser = OutputParser(tool_format="qwen3_coder", tools=TOOLS)
    pieces = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert merged(pieces) == [CallStarted(0, "get_weather"), ArgumentsDelta(0, '{"city": "Par')]


@pytest.mark.parametrize(
    ("kwargs", "text", "reasoning", "message"),
    [
        ({"reasoning": True}, "\n  Thinking it over.\n</think>\n\n  Answer.", "Thinking it over.\n", "Answer."),
        ({}, "  <think>\nModel opened it.</think>\nAnswer.", "Model opened it.", "Answer."),
        ({}, "No thinking here.", "", "No thinking here."),
        ({}, "<thin", "", "<thin"),
        ({"reasoning": True}, "Cut off while thinking", "Cut off while thinking", ""),
    ],
)
def test_reasoning(kwargs: dict[str, Any], text: str, reasoning: str, message: str) -> None:
    think = ("<think>", "</think>")
    for chunks in ([text], list(text)):
        pieces = run(chunks, tool_format="json_tools", think=think, **kwargs)
        assert summary(pieces)[:2] == (reasoning, message)


def test_truncated_call() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    for chunks in ([text], list(text)):
        pieces = merged(run(chunks, tool_format="json_tools", tools=TOOLS))
        assert pieces == [
            CallStarted(0, "get_weather"),
            ArgumentsDelta(0, '{"city": "Par'),
            CallDone(0, "get_weather", '{"city": "Par', False),
        ]
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"
    done = summary(run(list(text), tool_format="qwen3_coder", tools=TOOLS))[2]
    assert done == [CallDone(0, "get_weather", '{"city": "Paris", "days": ', False)]
    # Cut off before the name is known: no call was announced, so it stays text.
    for fmt, text in [
        ("json_tools", '<tool_call>\n{"na'),
        ("mistral", "[TOOL_CALLS]get_wea"),
        ("llama3_json", '{"name'),
    ]:
        assert merged(run(list(text), tool_format=fmt)) == [TextDelta(text)]


def test_unknown_name_is_text() -> None:
    text = 'Hi \n<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert summary(run(list(text), tool_format="json_tools", tools=TOOLS))[1:3] == (text, [])
    text = '{"name": "rm_rf", "parameters": {}}'
    assert summary(run(list(text), tool_format="llama3_json", tools=TOOLS))[1:3] == (text, [])


def test_max_calls_drops_later_calls() -> None:
    text = hermes("get_weather", WEATHER) + hermes("get_time", TIME) + "\nAfter."
    pieces = merged(run(list(text), tool_format="json_tools", tools=TOOLS, max_calls=1))
    assert [type(p).__name__ for p in pieces] == ["CallStarted", "ArgumentsDelta", "CallDone", "TextDelta"]
    assert pieces[-1] == TextDelta("After.")


def test_no_tool_format_is_all_text() -> None:
    text = hermes("get_weather", WEATHER)
    assert merged(run(list(text), tool_format=None)) == [TextDelta(text)]


def test_buffered_format_emits_the_call_at_its_end() -> None:
    head = 'Calling.<|tool_call_start|>[get_weather(city="Paris", days=2)]'
    parser = OutputParser(tool_format="pythonic", tools=TOOLS)
    assert merged(parser.feed(head)) == [TextDelta("Calling.")]
    assert merged(parser.feed("<|tool_call_end|>Done.") + parser.finish()) == [
        CallStarted(0, "get_weather"),
        ArgumentsDelta(0, '{"city": "Paris", "days": 2}'),
        CallDone(0, "get_weather", '{"city": "Paris", "days": 2}', True),
        TextDelta("Done."),
    ]
    text = "<|tool_call_start|>not a call<|tool_call_end|>"
    assert summary(run([text], tool_format="pythonic"))[1] == text


def test_inferred_formats(family_dirs: dict[str, Path], tokenizers: dict[str, Tokenizer]) -> None:
    for family, path in family_dirs.items():
        template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
        vocab = tokenizers[family].get_vocab()
        assert infer_tool_format(template, vocab) == FAMILY_FORMAT[family]
        assert think_markers(vocab) == (("<think>", "</think>") if family == "hermes_think" else None)
    assert infer_tool_format(None, {}) is None
    assert infer_tool_format("{{ messages }}", {"a": 0}) is None


@pytest.mark.parametrize("family", list(FAMILY_FORMAT))
def test_calls_rendered_by_the_family_template(
    family_dirs: dict[str, Path], tokenizers: dict[str, Tokenizer], family: str
) -> None:
    """What the template writes for an assistant's calls is what the parser reads back."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    config = json.loads((family_dirs[family] / "tokenizer_config.json").read_text())
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(config["chat_template"])
    calls = [("get_weather", {"city": "Paris <b>&'", "days": 2}), ("get_time", TIME)]
    content = "" if family == "llama3" else "Checking."
    assistant = {
        "role": "assistant",
        "content": content,
        "reasoning_content": "Weather first.",
        "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
    }
    user = [{"role": "user", "content": "Weather in Paris?"}]
    special = {"bos_token": config["bos_token"], "eos_token": config["eos_token"]}
    prompt = template.render(messages=user, add_generation_prompt=True, **special)
    rendered = template.render(messages=[*user, assistant], add_generation_prompt=False, **special)
    assert rendered.startswith(prompt)
    output = rendered[len(prompt) :].split(config["eos_token"])[0]
    kwargs = parser_kwargs(family, {"reasoning": family == "hermes_think"})
    reasoning, text, done, streamed = summary(run(token_deltas(tokenizers[family], output), **kwargs))
    assert (reasoning, text) == ("Weather first.\n" if family == "hermes_think" else "", content.strip())
    assert [(d.name, json.loads(d.arguments), d.valid) for d in done] == [(n, a, True) for n, a in calls]
    assert [streamed[d.index] for d in done] == [d.arguments for d in done]
