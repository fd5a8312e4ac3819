"""Resolve a model name (alias, built-in, local directory, Hugging Face repo) to a directory."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import msgspec

from lmspd.config import Config
from lmspd.errors import ModelError, ModelNotFoundError
from lmspd.models.catalog import BUILTIN_MODELS
from lmspd.models.pull import Progress, is_pulled, pull_builtin
from lmspd.models.sampling import LMSPD_DEFAULTS, SamplingDefaults, model_defaults

_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelInfo(msgspec.Struct, kw_only=True):
    name: str
    source: str  # "builtin" | "alias" | "local" | "huggingface"
    path: str | None  # None while a built-in is not yet pulled
    pulled: bool
    description: str = ""


class ResolvedModel(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    path: Path

    @property
    def context_length(self) -> int:
        return _context_length(self.path)


def context_length_of(config: dict[str, Any]) -> int:
    """A model's context window from its config.json (4096 when it says nothing)."""
    return int(config.get("max_position_embeddings") or config.get("max_seq_len") or 4096)


@functools.lru_cache(maxsize=64)
def _context_length(path: Path) -> int:
    return context_length_of(json.loads((path / "config.json").read_text()))


class ModelRegistry:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.cache_dir = config.model_cache_dir

    def known_names(self) -> list[str]:
        return sorted(set(self.config.models) | set(BUILTIN_MODELS))

    def resolve(
        self, name: str, *, pull: bool = True, progress: Progress | None = None, download: bool = False
    ) -> ResolvedModel:
        """Find (and, for a built-in, pull) the model; ModelNotFoundError names the known ones.
        The resolved name is the model's one identity, whatever the spelling: a built-in's
        name, else the first alias of its directory, else the directory itself. A hub id is
        downloaded only when the configuration names it or ``download`` (the command line)
        says so; a request's is looked up in the local cache only."""
        target = name
        if name in self.config.models:
            target = self.config.models[name].path
        if target in BUILTIN_MODELS:
            path = self.cache_dir / target
            if not is_pulled(path):
                if not pull:
                    raise ModelNotFoundError(
                        f"model '{name}' is not pulled yet: run `lmspd models pull {target}`", param="model"
                    )
                path = pull_builtin(BUILTIN_MODELS[target], self.cache_dir, progress=progress or _quiet)
            return ResolvedModel(name=target, path=path)
        local = Path(target).expanduser()
        if _is_model_dir(local):
            return self._model_at(name, local)
        if _HF_REPO.match(target) and not _exists(local):
            return self._model_at(name, _hf_snapshot(target, download=download or self._configured(name)))
        raise ModelNotFoundError(
            f"model '{_shown(name)}' not found; known models: {', '.join(self.known_names())} "
            "(or a local mlx-lm directory, or a Hugging Face repo id)",
            param="model",
        )

    def _configured(self, name: str) -> bool:
        return name in self.config.models or name == self.config.default_model

    def _model_at(self, name: str, path: Path) -> ResolvedModel:
        """The model in directory ``path``, checked to have what loading it needs: a directory
        that looks like a model but cannot be loaded is the client's error when the client
        named it (found at intake, before any task is made), the configuration's when an
        alias or the default model points there."""
        if (missing := _unusable(path)) is None:
            return self._canonical(path.resolve())
        what = f"directory {_shown(str(path))} is not a usable mlx-lm model: {missing}"
        if self._configured(name):
            raise ModelError(f"model '{name}': {what} (fix its path in the configuration)", param="model")
        raise ModelNotFoundError(
            f"model '{_shown(name)}' not found: {what} (a model directory holds config.json, "
            "tokenizer.json and *.safetensors weights)",
            param="model",
        )

    def _canonical(self, path: Path) -> ResolvedModel:
        # A built-in model's own directory is that built-in, however it is named: one
        # directory, one model (and one copy of its weights in the engine).
        for builtin in BUILTIN_MODELS:
            own = self.cache_dir / builtin
            if _resolved(own) == path and is_pulled(own):
                return ResolvedModel(name=builtin, path=own)
        for alias in sorted(self.config.models):
            alias_path = Path(self.config.models[alias].path).expanduser()
            if _is_model_dir(alias_path) and alias_path.resolve() == path:
                return ResolvedModel(name=alias, path=path)
        return ResolvedModel(name=str(path), path=path)

    def check_requested(self, name: str | None) -> None:
        """A model a client named: configured aliases, the default model and pulled built-ins;
        a directory or a hub id in the local cache only with ``server.allow_model_paths`` (a
        client must not make the server read arbitrary paths, nor download anything)."""
        if name is None or self._configured(name):
            return
        if name in BUILTIN_MODELS:
            if is_pulled(self.cache_dir / name):
                return
            raise ModelNotFoundError(f"model '{name}' is not pulled yet: run `lmspd models pull {name}`", param="model")
        if self.config.server.allow_model_paths:
            return
        raise ModelNotFoundError(
            f"model '{_shown(name)}' not found; known models: {', '.join(self.known_names())} "
            "(directories and Hugging Face repo ids need [server] allow_model_paths = true)",
            param="model",
        )

    def resolve_local(self, name: str) -> ResolvedModel | None:
        """Resolve without network or pulls: None for a configured hub id not yet downloaded
        or an unpulled built-in (those are fetched when the task runs); ModelNotFoundError
        for anything unknown."""
        target = self.config.models[name].path if name in self.config.models else name
        if target in BUILTIN_MODELS:
            return self.resolve(name) if is_pulled(self.cache_dir / target) else None
        if _is_model_dir(Path(target).expanduser()):
            return self.resolve(name)
        if _HF_REPO.match(target) and not _exists(Path(target).expanduser()):
            try:
                return self._model_at(name, _hf_snapshot(target, download=False))
            except ModelNotFoundError:
                if self._configured(name):
                    return None
                raise
        return self.resolve(name)  # raises ModelNotFoundError naming the known models

    def sampling_defaults(self, name: str, model: ResolvedModel | None) -> SamplingDefaults | None:
        """What a request on ``name`` samples with where it names nothing (docs/operations.md,
        "Sampling defaults"): ``model``'s directory's generation_config.json over the catalog's
        values for a built-in, over lmspd's own. ``model`` None (``resolve_local``'s: not here
        yet): a built-in's catalog values; None for anything else, known only once it is here.
        Under ``sampling_defaults = "openai"``, lmspd's own (OpenAI's) for every model."""
        if self.config.sampling_defaults == "openai":
            return LMSPD_DEFAULTS
        target = self.config.models[name].path if name in self.config.models else name
        builtin = BUILTIN_MODELS.get(model.name if model is not None else target)
        if model is None and builtin is None:
            return None
        return model_defaults(model.path if model is not None else None, builtin.sampling if builtin else None)

    def list(self) -> list[ModelInfo]:
        infos: list[ModelInfo] = []
        for name, builtin in BUILTIN_MODELS.items():
            path = self.cache_dir / name
            pulled = is_pulled(path)
            infos.append(
                ModelInfo(
                    name=name,
                    source="builtin",
                    path=str(path) if pulled else None,
                    pulled=pulled,
                    description=builtin.description,
                )
            )
        for alias, entry in self.config.models.items():
            target = entry.path
            if target in BUILTIN_MODELS:
                pulled = is_pulled(self.cache_dir / target)
            else:
                pulled = (Path(target).expanduser() / "config.json").is_file()
            infos.append(ModelInfo(name=alias, source="alias", path=target, pulled=pulled))
        return infos


def _quiet(stage: str, done: int, total: int) -> None:
    pass


def _is_model_dir(path: Path) -> bool:
    try:
        return (path / "config.json").is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return False


def _unusable(path: Path) -> str | None:
    """What keeps a directory with a config.json from loading as a model (None: nothing
    found): the files the engine and the tokenizer need, and a config that is an object."""
    try:
        config = json.loads((path / "config.json").read_bytes())
        if not (path / "tokenizer.json").is_file():
            return "it has no tokenizer.json"
        if next(path.glob("*.safetensors"), None) is None:
            return "it has no weights (*.safetensors)"
    except ValueError:
        return "its config.json is not valid JSON"
    except OSError as exc:
        return f"its files cannot be read ({exc.strerror or exc})"
    return None if isinstance(config, dict) else "its config.json is not a JSON object"


def _resolved(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _shown(name: str) -> str:
    """A client's model name as an error message repeats it: bounded."""
    return name if len(name) <= 200 else f"{name[:200]}..."


def _hf_snapshot(repo: str, *, download: bool) -> Path:
    """A Hugging Face mlx-lm repo from the local HF cache, downloaded first if ``download``."""
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo,
                allow_patterns=["*.json", "*.safetensors", "*.py", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"],
                local_files_only=not download,
            )
        )
    except Exception as exc:  # network errors, missing repos, gated repos, not in the cache
        if not download:
            raise ModelNotFoundError(
                f"model '{_shown(repo)}' is not in the local Hugging Face cache (a request cannot make the server "
                "download it: run `lmspd models pull` or configure it as an alias)",
                param="model",
            ) from None
        raise ModelNotFoundError(
            f"model '{repo}' could not be fetched from Hugging Face: {exc}", param="model"
        ) from exc
