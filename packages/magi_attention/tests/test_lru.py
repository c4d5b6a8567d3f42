"""The bounded LRU rule of the runtime's small caches (magi_attention._lru.remember)."""

from __future__ import annotations

from collections import OrderedDict

from magi_attention._lru import remember


def test_remember_keeps_the_most_recent_entries() -> None:
    table: OrderedDict[str, int] = OrderedDict()
    assert remember(table, "a", 1, 2) == 1
    remember(table, "b", 2, 2)
    remember(table, "a", 3, 2)  # refreshed: now the most recent, with its new value
    remember(table, "c", 4, 2)  # over the size: the least recently used ("b") goes
    assert list(table.items()) == [("a", 3), ("c", 4)]
