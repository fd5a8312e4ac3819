"""One Config, loaded from TOML, overridden by environment variables and flags.

Precedence: command-line flags > environment > config file > defaults. Every
section rejects unknown keys so a typo fails loudly, naming the key.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from service.errors import ConfigError

WeightDtype = Literal["auto", "quantized", "float32", "float16", "bfloat16"]
DEFAULT_MODEL = "smollm2-135m-instruct"


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_concurrency: int = 4
    max_loaded_models: int = 1
    weight_dtype: WeightDtype = "auto"
    prefill_step_size: int = 512

    def __post_init__(self) -> None:
        _positive("engine.max_concurrency", self.max_concurrency)
        _positive("engine.max_loaded_models", self.max_loaded_models)
        _positive("engine.prefill_step_size", self.prefill_step_size)


class ModelEntry(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # A local mlx-lm directory, a Hugging Face repo id, or a built-in model name.
    path: str


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    default_model: str = DEFAULT_MODEL
    cache_dir: str | None = None
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    models: dict[str, ModelEntry] = msgspec.field(default_factory=dict)

    @property
    def model_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "lmspd" / "models"


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key} must be >= 1, got {value}", param=key)


# Environment variables, each mapped to its dotted config key.
ENV_VARS = {
    "LMSPD_CACHE_DIR": "cache_dir",
    "LMSPD_DEFAULT_MODEL": "default_model",
    "LMSPD_MAX_CONCURRENCY": "engine.max_concurrency",
    "LMSPD_MAX_LOADED_MODELS": "engine.max_loaded_models",
    "LMSPD_WEIGHT_DTYPE": "engine.weight_dtype",
}


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def load_config(
    path: Path | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Build the Config; ``overrides`` are dotted keys from command-line flags."""
    environ = dict(os.environ) if environ is None else environ
    tree: dict[str, Any] = {}
    path = path or (Path(environ["LMSPD_CONFIG"]) if environ.get("LMSPD_CONFIG") else None)
    if path is not None:
        try:
            tree = tomllib.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for var, key in ENV_VARS.items():
        if var in environ:
            _set(tree, key, environ[var])
    for key, value in (overrides or {}).items():
        if value is not None:
            _set(tree, key, value)
    try:
        # strict=False lets environment strings like "8" become ints.
        return msgspec.convert(tree, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
