"""mlx-lm without transformers or huggingface_hub, for the engine process.

The engine uses mlx-lm's models, ``BatchGenerator``, caches and samplers, never its
tokenizer wrapper (lmspd tokenizes with ``tokenizers`` itself) nor its downloads (the server
resolves every model to a local directory first). But importing any of them runs
``mlx_lm/__init__``, whose tokenizer module imports transformers (about 1.4 s and tens of MB
of an engine that starts on every server start and after every crash) and whose utils bind
huggingface_hub's ``snapshot_download`` (23 MB and 349 modules: httpx, yaml, filelock...;
docs/memory.md). So the modules are imported with placeholders standing in for the handful of
names mlx-lm binds at import time (type hints, a subclass, a registration, a function), and
the placeholders are withdrawn straight after: a later ``import transformers`` or
``import huggingface_hub`` in this process gets the real package.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

# Every module the engine imports from mlx-lm; ``import_mlx_lm`` brings them in at once.
MODULES = ("mlx_lm.generate", "mlx_lm.utils", "mlx_lm.models.cache", "mlx_lm.sample_utils")
# The transformers names mlx-lm binds at import (mlx-lm 0.31-0.32): module -> names.
_BOUND = {
    "transformers": ("AutoTokenizer", "PreTrainedTokenizer", "PreTrainedTokenizerFast"),
    "transformers.tokenization_utils_base": ("PreTrainedTokenizerBase",),
}
# The huggingface_hub functions mlx-lm binds at import (``mlx_lm.utils``): stood in for only
# where the real package is not loaded already.
_BOUND_FUNCTIONS = {"huggingface_hub": ("snapshot_download",)}


class Placeholder:
    """Stands in for a transformers class in mlx-lm's module globals; never instantiated
    by the engine."""

    @classmethod
    def register(cls, *args: object, **kwargs: object) -> None:
        """``AutoTokenizer.register``, which mlx-lm calls at import."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("transformers is not loaded in the engine process")


def _not_loaded(*args: object, **kwargs: object) -> None:
    """Stands in for a huggingface_hub function in mlx-lm's module globals; never called by
    the engine, which loads local directories only."""
    raise RuntimeError("huggingface_hub is not loaded in the engine process")


@contextmanager
def _placeholders() -> Iterator[None]:
    added = []
    for name, attrs in _BOUND.items():
        module = types.ModuleType(name)
        for attr in attrs:
            setattr(module, attr, type(attr, (Placeholder,), {"apply_chat_template": None}))
        sys.modules[name] = module
        added.append(name)
    sys.modules["transformers"].tokenization_utils_base = sys.modules[  # type: ignore[attr-defined]
        "transformers.tokenization_utils_base"
    ]
    for name, functions in _BOUND_FUNCTIONS.items():
        if name in sys.modules:  # the real package: mlx-lm binds its functions
            continue
        module = types.ModuleType(name)
        for function in functions:
            setattr(module, function, _not_loaded)
        sys.modules[name] = module
        added.append(name)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def import_mlx_lm() -> bool:
    """Import the engine's mlx-lm modules; True if transformers (and huggingface_hub, unless
    already loaded) were kept out. A process that already has transformers (or already
    imported mlx-lm) imports them as usual."""
    import importlib

    if "transformers" in sys.modules or "mlx_lm" in sys.modules:
        for module in MODULES:
            importlib.import_module(module)
        return False
    try:
        with _placeholders():
            for module in MODULES:
                importlib.import_module(module)
    except ImportError:
        # An mlx-lm that binds other names: forget the half-imported package, import it whole.
        for name in [m for m in sys.modules if m == "mlx_lm" or m.startswith("mlx_lm.")]:
            del sys.modules[name]
        for module in MODULES:
            importlib.import_module(module)
        return False
    return True
