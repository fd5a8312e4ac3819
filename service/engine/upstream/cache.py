"""mlx-lm's ``LRUPromptCache`` where its public methods do not reach."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any


def exact_entry(lru: Any, namespace: Hashable, tokens: Sequence[int]) -> Any | None:
    """The entry stored under exactly ``(namespace, tokens)``, or None. mlx-lm offers only the
    nearest match (``fetch_nearest_cache``, which also copies); its trie (``lru._trie``,
    private in mlx-lm 0.31-0.32) is the one source of truth for an exact key."""
    try:
        return lru._trie.get(namespace, list(tokens))
    except KeyError:
        return None
