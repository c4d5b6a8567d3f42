"""The fused in-place out/lse merge, now magi_ffa's (``magi_ffa.merge_out_lse_``): one kernel for both packages.

Kept as a module so ``magi_ffa_fa4.merge.merge_out_lse_`` still imports.
"""

from magi_ffa import merge_out_lse_

__all__ = ["merge_out_lse_"]
