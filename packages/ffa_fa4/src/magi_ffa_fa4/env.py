"""Every environment variable magi_ffa_fa4 reads, in one place: one function per variable; the library
never writes them. (FlashAttention-4 and the CuTe DSL read their own; magi_ffa's are in ``magi_ffa.env``.)
The one exception: importing this module turns FA4's on-disk kernel cache on (``COMPILE_CACHE``,
``magi_ffa.compile_cache``) unless the user set ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED`` themselves.

Booleans accept ``0`` / ``1`` / ``true`` / ``false`` in any case (unset or empty = the default) and raise
``ValueError`` naming the variable for anything else. ``docs/flags.md`` lists every package's variables.
"""

from __future__ import annotations

import os

from magi_mask.flags import parse_bool, parse_positive_int

from magi_ffa.compile_cache import CacheState, enable_vendor_cache

__all__ = ["PACKAGE_VERSION", "plan_cache_size", "poison", "r2p", "varlen"]


PACKAGE_VERSION = "0.1.0"
"""The [project] version of pyproject.toml (CI checks that ``__version__`` agrees); part of the compile
cache's directory name (``magi_ffa.compile_cache``)."""


def _flag(name: str, default: bool) -> bool:
    return parse_bool(name, os.environ.get(name), default)


def plan_cache_size() -> int:
    """``MAGI_FFA_FA4_PLAN_CACHE`` (positive int, default 64): launch metadata kept (LRU), one entry per
    distinct mask and device. Read once, when the package is imported."""
    return parse_positive_int("MAGI_FFA_FA4_PLAN_CACHE", os.environ.get("MAGI_FFA_FA4_PLAN_CACHE"), 64)


def r2p() -> bool:
    """``MAGI_FFA_FA4_R2P`` (boolean, default true): row-bitmask masking on sm90 forward tiles; false falls
    back to the per-element mask_mod everywhere. Read when launch metadata is built (call
    ``clear_launch_cache`` after changing it)."""
    return _flag("MAGI_FFA_FA4_R2P", True)


def varlen() -> bool:
    """``MAGI_FFA_FA4_VARLEN`` (boolean, default true): masks whose slices form one FA4 varlen call (packed
    documents, causal or full; ``varlen.plan_varlen``) run FA4's own varlen kernels; false keeps the block-sparse path for every mask. Read when
    launch metadata is built (call ``clear_launch_cache`` after changing it)."""
    return _flag("MAGI_FFA_FA4_VARLEN", True)


def poison() -> bool:
    """``MAGI_FFA_FA4_POISON`` (boolean, default false): FA4's output buffer starts as NaN, so any element the
    kernel does not write shows up (tests)."""
    return _flag("MAGI_FFA_FA4_POISON", False)


COMPILE_CACHE: CacheState = enable_vendor_cache("fa4", os.path.dirname(__file__), PACKAGE_VERSION)
"""The vendor's on-disk kernel cache as decided when this package was imported (before any vendor import:
the vendor reads its cache variables once, when it is imported; ``magi_ffa.compile_cache``)."""
