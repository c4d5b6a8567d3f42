"""magi_ffa: Flex-Flash-Attention, one attention kernel whose mask is a list of slices.

``flex_flash_attn_func`` is the autograd / torch.compile entry; ``ffa_fwd`` / ``ffa_bwd`` are the launchers the
distributed runtime calls; ``reference`` is the blockwise torch path; ``testing`` holds shared test helpers.
"""

from . import reference, testing
from ._common import AttnType, Backend, merge_out_lse, triton_head_dim_ok
from ._ops import ffa_bwd, ffa_fwd, flex_flash_attn_func

__all__ = [
    "AttnType",
    "Backend",
    "ffa_bwd",
    "ffa_fwd",
    "flex_flash_attn_func",
    "merge_out_lse",
    "reference",
    "testing",
    "triton_head_dim_ok",
]
