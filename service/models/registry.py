"""Resolve a model name (alias, built-in, local directory, Hugging Face repo) to a directory."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import msgspec

from ..config import Config
from ..errors import ModelNotFoundError
from .catalog import BUILTIN_MODELS
from .pull import Progress, is_pulled, pull_builtin

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

    def resolve(self, name: str, *, pull: bool = True, progress: Progress | None = None) -> ResolvedModel:
        """Find (and, for a built-in, pull) the model; ModelNotFoundError names the known ones."""
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
            return ResolvedModel(name=name, path=path)
        local = Path(target).expanduser()
        if (local / "config.json").is_file():
            return ResolvedModel(name=name, path=local.resolve())
        if _HF_REPO.match(target) and not local.exists():
            return ResolvedModel(name=name, path=_hf_snapshot(target))
        raise ModelNotFoundError(
            f"model '{name}' not found; known models: {', '.join(self.known_names())} "
            "(or a local mlx-lm directory, or a Hugging Face repo id)",
            param="model",
        )

    def check_requested(self, name: str | None) -> None:
        """A model a client named: configured aliases, built-ins and the default model; a
        directory or hub id only with ``server.allow_model_paths`` (a client must not make the
        server read arbitrary paths)."""
        if name is None or self.config.server.allow_model_paths:
            return
        if name in self.config.models or name in BUILTIN_MODELS or name == self.config.default_model:
            return
        raise ModelNotFoundError(
            f"model '{name}' not found; known models: {', '.join(self.known_names())} "
            "(directories and Hugging Face repo ids need [server] allow_model_paths = true)",
            param="model",
        )

    def resolve_local(self, name: str) -> ResolvedModel | None:
        """Resolve without network or pulls: None for a Hugging Face id or an unpulled built-in
        (those are fetched when the task runs); ModelNotFoundError for anything unknown."""
        target = self.config.models[name].path if name in self.config.models else name
        if target in BUILTIN_MODELS:
            return self.resolve(name) if is_pulled(self.cache_dir / target) else None
        if (Path(target).expanduser() / "config.json").is_file():
            return self.resolve(name)
        if _HF_REPO.match(target) and not Path(target).expanduser().exists():
            return None
        return self.resolve(name)  # raises ModelNotFoundError naming the known models

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


def _hf_snapshot(repo: str) -> Path:
    """Download (or find in the local HF cache) a Hugging Face mlx-lm repo."""
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo,
                allow_patterns=["*.json", "*.safetensors", "*.py", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"],
            )
        )
    except Exception as exc:  # network errors, missing repos, gated repos
        raise ModelNotFoundError(
            f"model '{repo}' could not be fetched from Hugging Face: {exc}", param="model"
        ) from exc
