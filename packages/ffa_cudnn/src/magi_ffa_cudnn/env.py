"""Every environment variable magi_ffa_cudnn reads, in one place; the library never writes them. (cuDNN's
frontend and the CuTe DSL read their own; ``docs/flags.md`` lists every package's variables.)"""

from __future__ import annotations

import os

from magi_ffa.env import parse_positive_int

__all__ = ["plan_cache_size"]


def plan_cache_size() -> int:
    """``MAGI_FFA_CUDNN_PLAN_CACHE`` (positive int, default 64): cuDNN mask plans kept (LRU), one per distinct
    mask, geometry (heads, head_dim, dtype) and device. Read once, when the package is imported."""
    return parse_positive_int("MAGI_FFA_CUDNN_PLAN_CACHE", os.environ.get("MAGI_FFA_CUDNN_PLAN_CACHE"), 64)
