"""A model's sampling defaults: what a request that names no temperature (top_p, ...) samples
with (docs/operations.md, "Sampling defaults").

A model's own values come from its directory's ``generation_config.json`` (Hugging Face's
file, the keys lmspd's sampler implements), over the catalog's recommended values for a
built-in model, over lmspd's own (OpenAI's: temperature 1, top_p 1, no top_k or min_p). The
ranges every value is held to, a request's or a model's, are here too: one definition.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("lmspd.models")

GENERATION_CONFIG = "generation_config.json"


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a request samples with where it names none of these (the models lists show it; a
    task stores the one it was accepted with, so a resumed task samples as it began)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    min_p: float = 0.0  # 0: no min-p filter


# Before models had defaults of their own, every request that named none sampled with these.
LMSPD_DEFAULTS = SamplingDefaults()
KEYS = tuple(SamplingDefaults.__struct_fields__)


def out_of_range(name: str, value: float) -> str | None:
    """Why ``value`` cannot be sampling parameter ``name`` (None: it can). A request's values
    are refused with this (a 400 naming the parameter); a model's are ignored with it."""
    if name == "temperature" and not 0.0 <= value <= 2.0:
        return f"temperature must be between 0 and 2, got {value}"
    if name == "top_p" and not 0.0 < value <= 1.0:
        return f"top_p must be in (0, 1], got {value}"
    if name == "top_k" and value < 0:
        return f"top_k must be >= 0, got {value}"
    if name == "min_p" and not 0.0 <= value <= 1.0:
        return f"min_p must be in [0, 1], got {value}"
    return None


def model_defaults(directory: Path | None, catalog: SamplingDefaults | None) -> SamplingDefaults:
    """A model's defaults: its ``directory``'s generation_config.json (None: not here yet), key
    by key over ``catalog`` (a built-in's recommended values), over lmspd's own. The file is
    read again only when it changes."""
    base = catalog or LMSPD_DEFAULTS
    if directory is None:
        return base
    try:
        stat = (directory / GENERATION_CONFIG).stat()
    except OSError:  # no file (most converted models, the built-in one): nothing to read
        return base
    return _over(base, _read(directory / GENERATION_CONFIG, stat.st_mtime_ns, stat.st_size))


def _over(base: SamplingDefaults, found: tuple[tuple[str, float], ...]) -> SamplingDefaults:
    return msgspec.structs.replace(base, **dict(found)) if found else base


@functools.lru_cache(maxsize=64)
def _read(path: Path, mtime_ns: int, size: int) -> tuple[tuple[str, float], ...]:
    """The sampling keys of a generation_config.json that lmspd's sampler implements, each a
    number in its range; the rest is said once in the log and left out. As vLLM's
    ``--generation-config auto`` does, ``do_sample`` is not read: a file that names a
    temperature means it (transformers' greedy default would make every value moot)."""
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        log.warning("%s is ignored: it cannot be read as JSON (%s)", path, exc)
        return ()
    if not isinstance(config, dict):
        log.warning("%s is ignored: it is not a JSON object", path)
        return ()
    found: list[tuple[str, float]] = []
    for key in KEYS:
        if (value := _value(path, key, config.get(key))) is not None:
            found.append((key, value))
    if (penalty := config.get("repetition_penalty")) not in (None, 1, 1.0):
        log.warning("%s: repetition_penalty %r is not applied (lmspd's sampler has none)", path, penalty)
    return tuple(found)


def _value(path: Path, key: str, raw: Any) -> int | float | None:
    if raw is None:
        return None
    whole = key == "top_k"
    if isinstance(raw, bool) or not isinstance(raw, int if whole else (int, float)) or not math.isfinite(raw):
        log.warning("%s: %s %r is ignored: not %s", path, key, raw, "an integer" if whole else "a number")
        return None
    if whole and raw < 0:  # vLLM's and llama.cpp's spelling of "no top-k"
        return 0
    if (why := out_of_range(key, raw)) is not None:
        log.warning("%s: %s is ignored: %s", path, key, why)
        return None
    return raw if whole else float(raw)
