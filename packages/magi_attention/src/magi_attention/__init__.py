"""magi_attention: distributed attention (context parallelism) with slice masks.

Main entry points live in `magi_attention.api`; configuration in `magi_attention.config`.
"""

from .api import (
    AttnForwardMeta,
    AttnMaskType,
    AttnOverlapMode,
    AttnRanges,
    DistAttnRuntimeKey,
    calc_attn,
    clear_cache,
    compute_pad_size,
    dispatch,
    dispatch_kv,
    get_most_recent_key,
    get_position_ids,
    infer_attn_mask_from_cu_seqlens,
    infer_attn_mask_from_mask_mod,
    infer_attn_mask_from_sliding_window,
    infer_varlen_mask_from_batch,
    magi_attn_flex_key,
    magi_attn_varlen_key,
    make_flex_key_for_new_mask_after_dispatch,
    make_varlen_key_for_new_mask_after_dispatch,
    roll,
    squash_batch_dim,
    undispatch,
    undispatch_kv,
)
from .config import DispatchAlg, DispatchConfig, DistAttnConfig, KernelBackend, OverlapConfig, OverlapMode

__version__ = "0.1.0"  # the [project] version of pyproject.toml (CI checks that they agree)

__all__ = [
    "AttnForwardMeta",
    "AttnMaskType",
    "AttnOverlapMode",
    "AttnRanges",
    "DispatchAlg",
    "DispatchConfig",
    "DistAttnConfig",
    "DistAttnRuntimeKey",
    "KernelBackend",
    "OverlapConfig",
    "OverlapMode",
    "calc_attn",
    "clear_cache",
    "compute_pad_size",
    "dispatch",
    "dispatch_kv",
    "get_most_recent_key",
    "get_position_ids",
    "infer_attn_mask_from_cu_seqlens",
    "infer_attn_mask_from_mask_mod",
    "infer_attn_mask_from_sliding_window",
    "infer_varlen_mask_from_batch",
    "magi_attn_flex_key",
    "magi_attn_varlen_key",
    "make_flex_key_for_new_mask_after_dispatch",
    "make_varlen_key_for_new_mask_after_dispatch",
    "roll",
    "squash_batch_dim",
    "undispatch",
    "undispatch_kv",
]
