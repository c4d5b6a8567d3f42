"""magi_ffa_fa4: the FFA API on FlashAttention-4's CuTe DSL kernels (validated on Hopper sm90; the same code
selects FA4's sm100 kernels on Blackwell, where it has not run).

The metadata parts (tile classes and block lists on magi_ffa's row intervals, re-exported here) need only torch and Triton; the attention entry
point needs ``flash-attn-4`` and raises an ImportError saying what to install when it is missing.

The package provides FA4's launchers and its capability (``CAPABILITY``); the entry points are
``magi_ffa.contract``'s, bound to them (``BACKEND``). ``deterministic_supported`` says on which masks
``deterministic=True`` is accepted (those that take FA4's varlen path).
"""

from magi_ffa import merge_out_lse_
from magi_ffa._deprecation import deprecated_aliases
from magi_ffa.intervals import RowIntervals, row_intervals, row_intervals_reference

# first: importing env turns the vendor's on-disk kernel cache on, before anything imports the vendor
from . import env
from ._launch_meta import clear_launch_cache, compile_key, warmup_masks
from .blocks import BlockLists, BlockSparseMeta, block_classes, build_block_meta
from .interface import (
    BACKEND,
    CAPABILITY,
    INSTALL_HINT,
    deterministic_supported,
    fa4_available,
    ffa_bwd,
    ffa_fwd,
    flex_flash_attn_func,
    head_dim_supported,
)

__all__ = [
    "BACKEND",
    "CAPABILITY",
    "INSTALL_HINT",
    "BlockLists",
    "BlockSparseMeta",
    "RowIntervals",
    "block_classes",
    "build_block_meta",
    "clear_launch_cache",
    "compile_key",
    "deterministic_supported",
    "fa4_available",
    "ffa_bwd",
    "ffa_fwd",
    "flex_flash_attn_func",
    "head_dim_supported",
    "merge_out_lse_",
    "row_intervals",
    "row_intervals_reference",
    "warmup_masks",
]

__version__ = env.PACKAGE_VERSION  # the [project] version of pyproject.toml (CI checks that they agree)

# old names, for one release (docs/migration.md)
__getattr__ = deprecated_aliases(__name__, {"clear_plan_cache": "clear_launch_cache"})
