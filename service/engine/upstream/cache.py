"""mlx-lm's ``LRUPromptCache`` where its public methods do not reach."""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache


def exact_entry(lru: Any, namespace: Hashable, tokens: Sequence[int]) -> Any | None:
    """The entry stored under exactly ``(namespace, tokens)``, or None. mlx-lm offers only the
    nearest match (``fetch_nearest_cache``, which also copies); its trie (``lru._trie``,
    private in mlx-lm 0.31-0.32) is the one source of truth for an exact key."""
    try:
        return lru._trie.get(namespace, list(tokens))
    except KeyError:
        return None


def namespaces(lru: Any) -> list[Hashable]:
    """Every namespace the cache holds entries in (``lru._trie._trie``'s keys, as above)."""
    return list(lru._trie._trie)


def reach(lru: Any, namespace: Hashable, tokens: Sequence[int]) -> int:
    """How many leading tokens of ``tokens`` an entry in ``namespace`` holds, as
    ``fetch_nearest_cache`` would find it, without copying anything."""
    found = lru._trie.search(namespace, list(tokens))
    if found.exact is not None:
        return len(tokens)
    shorter = len(found.shorter) if found.shorter is not None else 0
    return max(shorter, found.common_prefix if found.longer is not None else 0)


def fetch_whole(lru: Any, namespace: Hashable, tokens: Sequence[int]) -> list[Any] | None:
    """A copy of the KV of exactly ``tokens``, from an entry that holds them all (as they are,
    or as the start of a longer one), or None. ``fetch_nearest_cache`` always leaves the last
    token out of a longer entry; this is its search without that rule."""
    found = lru._trie.search(namespace, list(tokens))
    if found.exact is not None:
        return copy.deepcopy(lru._trie.get(found.model, found.exact).prompt_cache)  # type: ignore[no-any-return]
    if found.longer is None or found.common_prefix < len(tokens):
        return None
    entry = lru._trie.get(found.model, found.longer)
    if not can_trim_prompt_cache(entry.prompt_cache):
        return None
    cache: list[Any] = copy.deepcopy(entry.prompt_cache)
    trim_prompt_cache(cache, len(found.longer) - len(tokens))
    return cache
