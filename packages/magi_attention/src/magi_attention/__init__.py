"""magi_attention: distributed attention (context parallelism) with slice masks.

Main entry points live in `magi_attention.api`; configuration in `magi_attention.config`.
"""

from .api import (
    AttnForwardMeta,
    DistAttnRuntimeKey,
    calc_attn,
    clear_cache,
    dispatch,
    get_most_recent_key,
    get_position_ids,
    infer_attn_mask_from_mask_mod,
    magi_attn_flex_key,
    magi_attn_varlen_key,
    make_flex_key_for_new_mask_after_dispatch,
    undispatch,
)
from .config import DispatchAlg, DispatchConfig, DistAttnConfig, OverlapConfig, OverlapMode

__all__ = [
    "AttnForwardMeta",
    "DispatchAlg",
    "DispatchConfig",
    "DistAttnConfig",
    "DistAttnRuntimeKey",
    "OverlapConfig",
    "OverlapMode",
    "calc_attn",
    "clear_cache",
    "dispatch",
    "get_most_recent_key",
    "get_position_ids",
    "infer_attn_mask_from_mask_mod",
    "magi_attn_flex_key",
    "magi_attn_varlen_key",
    "make_flex_key_for_new_mask_after_dispatch",
    "undispatch",
]
