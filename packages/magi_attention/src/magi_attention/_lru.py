"""The bounded least-recently-used tables of the runtime's small process-local caches (compiled mask
statistics, roll routes, layout lengths): one rule for storing an entry and evicting the oldest."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def remember(table: OrderedDict[K, V], key: K, value: V, size: int) -> V:
    """Store ``table[key] = value`` as the most recently used entry, drop the least recently used ones
    beyond ``size`` entries, and return ``value``."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > size:
        table.popitem(last=False)
    return value
