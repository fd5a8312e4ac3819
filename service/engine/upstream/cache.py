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
