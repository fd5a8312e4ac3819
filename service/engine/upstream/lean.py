"""mlx-lm without transformers, for the engine process.

The engine uses mlx-lm's models, ``BatchGenerator``, caches and samplers, never its
tokenizer wrapper (lmspd tokenizes with ``tokenizers`` itself). But importing any of them
runs ``mlx_lm/__init__``, whose tokenizer module imports transformers: about 1.4 s and tens
of MB of an engine that starts on every server start and after every crash. So the modules
are imported with placeholder classes standing in for the handful of transformers names
mlx-lm binds at import time (type hints, a subclass, a registration), and the placeholders
are withdrawn straight after: a later ``import transformers`` in this process gets the
real package.
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


class Placeholder:
    """Stands in for a transformers class in mlx-lm's module globals; never instantiated
    by the engine."""

    @classmethod
    def register(cls, *args: object, **kwargs: object) -> None:
        """``AutoTokenizer.register``, which mlx-lm calls at import."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("transformers is not loaded in the engine process")


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
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def import_mlx_lm() -> bool:
    """Import the engine's mlx-lm modules; True if transformers was kept out. A process that
    already has transformers (or already imported mlx-lm) imports them as usual."""
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
