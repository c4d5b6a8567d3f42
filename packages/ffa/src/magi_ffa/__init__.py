"""magi_ffa: Flex-Flash-Attention, one attention kernel whose mask is a list of slices.

``flex_flash_attn_func`` is the autograd / torch.compile entry; ``ffa_fwd`` / ``ffa_bwd`` are the launchers the
distributed runtime calls; ``reference`` is the blockwise torch path; ``testing`` holds shared test helpers;
``validation`` the input checks of the FFA contract; ``intervals`` the per-row key intervals of a slice
mask (torch and Triton builders, shared by the FA4 and cuDNN backends); ``merge_out_lse`` (torch, differentiable) and
``merge_out_lse_`` (fused Triton, in place) the out/lse merge; ``merge_sink`` / ``sink_grad`` attention sinks
on a final (out, lse) and their gradient; ``ffa_max_logits`` the max logits alone (a QK pass). ``KernelBackend``
is the one kernel-backend enum of every package (magi_ffa runs its ``triton`` and ``torch`` members).
``clear_mask_caches`` empties the one cache of per-mask data (checked slices and every backend's launch
data, :mod:`magi_ffa.mask_cache`). ``contract`` is the FFA contract written once: every backend (magi_ffa's two, magi_ffa_fa4, magi_ffa_cudnn) is a
``BackendCapability`` plus launchers on checked slices, bound by ``FFABackend`` into the public functions.
"""

from magi_mask import AttnMaskType

from . import contract, intervals, reference, testing, validation
from ._common import KernelBackend, triton_head_dim_ok
from ._merge import merge_out_lse, merge_out_lse_
from ._ops import ffa_bwd, ffa_fwd, ffa_max_logits, flex_flash_attn_func
from ._sink import merge_sink, sink_grad
from .contract import BackendCapability, FFABackend
from .intervals import RowIntervals, row_intervals, row_intervals_reference
from .mask_cache import clear_mask_caches

__version__ = "0.1.0"  # the [project] version of pyproject.toml (CI checks that they agree)

__all__ = [
    "AttnMaskType",
    "BackendCapability",
    "FFABackend",
    "KernelBackend",
    "RowIntervals",
    "clear_mask_caches",
    "contract",
    "ffa_bwd",
    "ffa_fwd",
    "ffa_max_logits",
    "flex_flash_attn_func",
    "intervals",
    "merge_out_lse",
    "merge_out_lse_",
    "merge_sink",
    "reference",
    "row_intervals",
    "row_intervals_reference",
    "sink_grad",
    "testing",
    "triton_head_dim_ok",
    "validation",
]
