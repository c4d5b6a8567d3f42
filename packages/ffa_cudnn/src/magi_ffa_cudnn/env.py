"""Every environment variable magi_ffa_cudnn reads, in one place; the library never writes them. (cuDNN's
frontend and the CuTe DSL read their own; ``docs/flags.md`` lists every package's variables.) The one
exception: importing this module turns cuDNN flex_attention's on-disk kernel cache on (``COMPILE_CACHE``,
``magi_ffa.compile_cache``) unless the user set ``FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED`` themselves."""

from __future__ import annotations

import os

from magi_mask.flags import parse_positive_int

from magi_ffa.compile_cache import CacheState, enable_vendor_cache

__all__ = ["PACKAGE_VERSION", "plan_cache_size"]


PACKAGE_VERSION = "0.1.0"
"""The [project] version of pyproject.toml (CI checks that ``__version__`` agrees); part of the compile
cache's directory name (``magi_ffa.compile_cache``)."""


def plan_cache_size() -> int:
    """``MAGI_FFA_CUDNN_PLAN_CACHE`` (positive int, default 64): cuDNN mask plans kept (LRU), one per distinct
    mask, geometry (heads, head_dim, dtype) and device. Read once, when the package is imported."""
    return parse_positive_int("MAGI_FFA_CUDNN_PLAN_CACHE", os.environ.get("MAGI_FFA_CUDNN_PLAN_CACHE"), 64)


COMPILE_CACHE: CacheState = enable_vendor_cache("cudnn", os.path.dirname(__file__), PACKAGE_VERSION)
"""The vendor's on-disk kernel cache as decided when this package was imported (before any vendor import:
the vendor reads its cache variables once, when it is imported; ``magi_ffa.compile_cache``)."""
