"""A model's sampling defaults (docs/operations.md, "Sampling defaults"): read from its
directory's generation_config.json, over the catalog's values for the bundled model, over
lmspd's own; a request's value wins over all of them, and a task keeps the defaults it was
accepted with."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lmspd.config import Config, ModelEntry, load_config
from lmspd.errors import ConfigError, InvalidRequestError
from lmspd.models.catalog import BUILTIN_MODELS
from lmspd.models.registry import ModelRegistry, ResolvedModel
from lmspd.models.sampling import LMSPD_DEFAULTS, SamplingDefaults, model_defaults
from lmspd.responses.schema import ResponseRequest, TaskRequest

BUNDLED = "smollm2-135m-instruct"
CATALOG = SamplingDefaults(temperature=0.2, top_p=0.9)


def model_dir(path: Path, generation_config: Any = None) -> Path:
    """A directory the registry takes for a model (its files' contents are never loaded here)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    if generation_config is not None:
        text = generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
        (path / "generation_config.json").write_text(text)
    return path


def test_the_bundled_models_catalog_entry_has_its_model_cards_values() -> None:
    assert BUILTIN_MODELS[BUNDLED].sampling == CATALOG


def test_the_sampling_keys_of_generation_config_json_are_read(tmp_path: Path) -> None:
    qwen_like = {
        "bos_token_id": 1,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "transformers_version": "4.51.0",
    }
    d = model_dir(tmp_path / "m", qwen_like)
    assert model_defaults(d, None) == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05)


def test_a_directory_without_the_file_or_a_model_not_here_has_the_catalogs_else_lmspds(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m")
    assert model_defaults(d, None) == LMSPD_DEFAULTS == SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, min_p=0)
    assert model_defaults(d, CATALOG) == CATALOG
    assert model_defaults(None, CATALOG) == CATALOG


def test_the_file_wins_key_by_key_over_the_catalog(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m", {"temperature": 0})
    assert model_defaults(d, CATALOG) == SamplingDefaults(temperature=0.0, top_p=0.9)


@pytest.mark.parametrize(
    ("config", "expected", "logged"),
    [
        # Out of the range a request is held to, or not a number: left out (and said), the rest kept.
        ({"temperature": 3.0, "top_p": 0.5}, SamplingDefaults(top_p=0.5), True),
        ({"top_p": 0, "min_p": 1.5, "temperature": 0.3}, SamplingDefaults(temperature=0.3), True),
        ({"temperature": "0.3", "top_k": 2.5, "min_p": True}, LMSPD_DEFAULTS, True),
        ({"temperature": None, "top_k": 40}, SamplingDefaults(top_k=40), False),
        # A negative top_k is vLLM's and llama.cpp's "none".
        ({"top_k": -1}, SamplingDefaults(top_k=0), False),
        # do_sample is not read (as vLLM): a temperature named is a temperature meant.
        ({"do_sample": False, "temperature": 0.7}, SamplingDefaults(temperature=0.7), False),
        # Not lmspd's sampler's: repetition_penalty said in the log; either changes nothing.
        ({"repetition_penalty": 1.1, "max_new_tokens": 64}, LMSPD_DEFAULTS, True),
        ("not json", LMSPD_DEFAULTS, True),
        ([0.5], LMSPD_DEFAULTS, True),
    ],
)
def test_values_lmspd_cannot_use_are_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, config: Any, expected: SamplingDefaults, logged: bool
) -> None:
    d = model_dir(tmp_path / "m", config)
    with caplog.at_level(logging.WARNING, logger="lmspd.models"):
        assert model_defaults(d, None) == expected
    assert (str(d / "generation_config.json") in caplog.text) == logged


def test_an_edited_file_is_read_again(tmp_path: Path) -> None:
    d = model_dir(tmp_path / "m", {"temperature": 0.5})
    assert model_defaults(d, None).temperature == 0.5
    path = d / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.25}))
    later = path.stat().st_mtime_ns + 10**9  # a new mtime even on a coarse clock
    os.utime(path, ns=(later, later))
    assert model_defaults(d, None).temperature == 0.25


def test_the_registry_finds_a_models_defaults_by_any_name(tmp_path: Path) -> None:
    tuned = model_dir(tmp_path / "tuned", {"temperature": 0, "top_k": 5})
    plain = model_dir(tmp_path / "plain")
    config = Config(
        cache_dir=str(tmp_path / "cache"),
        models={
            "tuned": ModelEntry(path=str(tuned)),
            "plain": ModelEntry(path=str(plain)),
            "smol": ModelEntry(path=BUNDLED),
            "hub": ModelEntry(path="example/not-downloaded"),
        },
    )
    registry = ModelRegistry(config)
    assert registry.sampling_defaults("tuned", registry.resolve_local("tuned")) == SamplingDefaults(
        temperature=0.0, top_k=5
    )
    assert registry.sampling_defaults("plain", registry.resolve_local("plain")) == LMSPD_DEFAULTS
    # The bundled model not pulled yet, by its name or an alias: its catalog values.
    assert registry.resolve_local(BUNDLED) is None
    assert registry.sampling_defaults(BUNDLED, None) == CATALOG
    assert registry.sampling_defaults("smol", None) == CATALOG
    # Its directory, once pulled, under any spelling: the built-in, its file over the catalog.
    own = model_dir(tmp_path / "cache" / BUNDLED, {"top_p": 0.5})
    assert registry.sampling_defaults(str(own), ResolvedModel(name=BUNDLED, path=own)) == SamplingDefaults(
        temperature=0.2, top_p=0.5
    )
    # A hub model not downloaded: known only once it is here.
    assert registry.sampling_defaults("hub", None) is None


MODEL = SamplingDefaults(temperature=0.0, top_p=0.5, top_k=7, min_p=0.1)


def test_a_request_that_names_none_gets_the_models_defaults() -> None:
    params = ResponseRequest(input="Hi").sampling(MODEL)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 0.5, 7, 0.1)


def test_a_requests_own_value_wins_and_an_explicit_zero_stays_greedy() -> None:
    params = ResponseRequest(input="Hi", temperature=1.5).sampling(MODEL)
    assert (params.temperature, params.top_p) == (1.5, 0.5)
    assert ResponseRequest(input="Hi", temperature=0, top_p=1).sampling(CATALOG).temperature == 0.0
    assert ResponseRequest(input="Hi", temperature=0, top_p=1).sampling(CATALOG).top_p == 1.0


def test_no_model_defaults_are_lmspds_own() -> None:
    params = ResponseRequest(input="Hi").sampling()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)


def test_a_task_keeps_the_defaults_it_was_accepted_with() -> None:
    stored = msgspec.json.encode(TaskRequest.of(ResponseRequest(input="Hi"), sampling_defaults=MODEL, seed=3))
    task = msgspec.json.decode(stored, type=TaskRequest)
    # The model's defaults by the time it runs again do not matter: the stored ones win.
    params = task.sampling(CATALOG)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (0.0, 0.5, 7, 0.1, 3)
    # A task stored without them (older, or its model not here at intake) takes the model's.
    older = msgspec.json.decode(msgspec.json.encode(TaskRequest(input="Hi")), type=TaskRequest)
    assert older.sampling_defaults is None and older.sampling(CATALOG).temperature == 0.2


def test_a_request_value_out_of_range_is_still_refused_naming_it() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        ResponseRequest(input="Hi", temperature=2.5).sampling(MODEL).validate()
    assert caught.value.param == "temperature" and "between 0 and 2" in caught.value.message


def test_sampling_defaults_openai_gives_every_model_lmspds_own(tmp_path: Path) -> None:
    tuned = model_dir(tmp_path / "tuned", {"temperature": 0, "top_k": 5})
    models = {"tuned": ModelEntry(path=str(tuned)), "hub": ModelEntry(path="example/not-downloaded")}
    environ = {"LMSPD_SAMPLING_DEFAULTS": "openai", "LMSPD_CACHE_DIR": str(tmp_path / "cache")}
    config = msgspec.structs.replace(load_config(environ=environ), models=models)
    assert config.sampling_defaults == "openai"
    registry = ModelRegistry(config)
    assert registry.sampling_defaults("tuned", registry.resolve_local("tuned")) == LMSPD_DEFAULTS
    assert registry.sampling_defaults(BUNDLED, None) == LMSPD_DEFAULTS
    assert registry.sampling_defaults("hub", None) == LMSPD_DEFAULTS
    with pytest.raises(ConfigError) as caught:
        load_config(environ={"LMSPD_SAMPLING_DEFAULTS": "vllm"})
    assert "sampling_defaults" in caught.value.message
