"""magi_ffa_fa4: the FFA API on FlashAttention-4's CuTe DSL kernels (Hopper sm90; Blackwell sm100 untested).

The metadata parts (row intervals, tile classes, block lists) need only torch and Triton; the attention entry
point needs ``flash-attn-4`` and raises an ImportError saying what to install when it is missing.
"""

from ._validation import AttnType
from .blocks import BlockLists, BlockSparseMeta, block_classes, build_block_meta
from .intervals import RowIntervals, row_intervals, row_intervals_reference

__all__ = [
    "AttnType",
    "BlockLists",
    "BlockSparseMeta",
    "RowIntervals",
    "block_classes",
    "build_block_meta",
    "row_intervals",
    "row_intervals_reference",
]
