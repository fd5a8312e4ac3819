"""Config: TOML file, environment, flags, in that order of precedence; bad keys are named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmspd.config import Config, load_config
from lmspd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults() -> None:
    config = load_config(environ={})
    assert config.default_model == "smollm2-135m-instruct"
    assert (config.engine.max_concurrency, config.engine.max_loaded_models) == (8, 1)
    assert config.engine.weight_dtype == "auto"
    assert config.model_cache_dir == Path.home() / ".cache" / "lmspd" / "models"


def test_example_config_loads_and_documents_every_key() -> None:
    example = ROOT / "config.example.toml"
    config = load_config(example, environ={})
    text = example.read_text()
    for key in Config.__struct_fields__:
        assert key in text
    for key in (
        *config.engine.__struct_fields__,
        *config.server.__struct_fields__,
        *config.responses.__struct_fields__,
        *config.store.__struct_fields__,
        *config.cluster.__struct_fields__,
    ):
        assert key in text


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('cache_dir = "/from/file"\n[engine]\nmax_concurrency = 2\nmax_loaded_models = 3\n')
    env = {"LMSPD_MAX_CONCURRENCY": "6", "LMSPD_CACHE_DIR": "/from/env"}
    config = load_config(path, overrides={"cache_dir": "/from/flag"}, environ=env)
    assert config.cache_dir == "/from/flag"
    assert config.engine.max_concurrency == 6
    assert config.engine.max_loaded_models == 3


def test_kernels_are_built_in_the_one_cache_directory_of_a_service() -> None:
    assert load_config(environ={}).engine.kernel_dir == ""  # the user's cache (kernels.cache_root)
    config = load_config(environ={"LMSPD_CACHE_DIR": "/var/cache/lmspd"})
    assert config.engine.kernel_dir == "/var/cache/lmspd/.kernels"
    named = load_config(environ={"LMSPD_CACHE_DIR": "/var/cache/lmspd", "LMSPD_KERNEL_DIR": "/opt/k"})
    assert named.engine.kernel_dir == "/opt/k"


def test_config_path_from_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('default_model = "mine"\n[models.mine]\npath = "/models/mine"\n')
    config = load_config(environ={"LMSPD_CONFIG": str(path)})
    assert config.models["mine"].path == "/models/mine"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[engine]\nmax_concurency = 3\n", "max_concurency"),
        ("[engine]\nmax_concurrency = 0\n", "engine.max_concurrency"),
        ('[engine]\nweight_dtype = "int3"\n', "weight_dtype"),
        ("[models.x]\nfile = 'a'\n", "file"),
        ("defualt_model = 'x'\n", "defualt_model"),
        ("[engine\n", "not valid TOML"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named):
        load_config(path, environ={})


def test_bad_environment_value_is_named() -> None:
    with pytest.raises(ConfigError, match="max_concurrency"):
        load_config(environ={"LMSPD_MAX_CONCURRENCY": "many"})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})


def test_seed_store_flags_environment_variables() -> None:
    env = {
        "LLAMA_ARG_RESPONSES_STORE_MAX_ENTRIES": "7",
        "MLXCEL_RESPONSES_BACKGROUND_MAX_JOBS": "0",
        "LLAMA_ARG_CONVERSATION_STORE_TTL_SECS": "0",
    }
    r = load_config(environ=env).responses
    assert (r.store_max_entries, r.background_max_jobs, r.conversation_store_ttl_secs) == (7, 0, 0)
    assert (r.store_max_bytes, r.store_ttl_secs, r.background_ephemeral_ttl_secs) == (268435456, 3600, 600)
    with pytest.raises(ConfigError, match="background_ephemeral_ttl_secs"):
        load_config(environ={"MLXCEL_RESPONSES_BACKGROUND_EPHEMERAL_TTL_SECS": "0"})


@pytest.mark.parametrize(
    ("text", "environ", "named"),
    [
        # One name, two tokens: the operator's would own the other's tasks.
        ('[server]\ntokens = { alice = "a1" }\nadmin_tokens = { alice = "a2" }\n', {}, "server.admin_tokens.alice"),
        ('[server]\nadmin_tokens = { alice = "a2" }\n', {"LMSP_API_KEYS": "alice:a1"}, "server.admin_tokens.alice"),
        # One token, two names: it would be whichever matched last (the operator's, here).
        ('[server]\ntokens = { bob = "t" }\nadmin_tokens = { ops = "t" }\n', {}, "server.admin_tokens.ops"),
        ('[server]\ntokens = { bob = "t", carol = "t" }\n', {}, "server.tokens.carol"),
    ],
    ids=["name-in-both", "name-in-both-by-env", "token-in-both", "token-twice"],
)
def test_a_name_or_token_given_twice_fails_at_start_naming_the_key(
    tmp_path: Path, text: str, environ: dict[str, str], named: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(named)) as raised:
        load_config(path, environ=environ)
    assert raised.value.param == named
    assert '"t"' not in raised.value.message and "a1" not in raised.value.message  # never the token


def test_distinct_operator_and_ordinary_tokens_load() -> None:
    config = load_config(environ={"LMSP_API_KEYS": "alice:a1,bob:b1"}, overrides={"server.admin_tokens": {"ops": "o1"}})
    assert config.server.tokens == {"alice": "a1", "bob": "b1"} and config.server.admin_tokens == {"ops": "o1"}
