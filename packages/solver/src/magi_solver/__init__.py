"""magi_solver: pure-Python planning for distributed attention (no torch).

Mask algebra (`AttnRange`, `AttnRanges`, `AttnMaskType`, `AttnSlice`), mask builders, the dispatch solver
(`solve_dispatch`), and the full plan (`plan_attention`, which also chooses the chunk size per mask;
`plan_dist_attn` is its keyword wrapper): per-rank host/remote slices, GroupCast/GroupReduce
arguments and overlap stages, with the overlap degree priced by a cost model (`OverlapCostModel`, `CostProfile`,
`get_profile`).
"""

from .builders import (
    MaskSpec,
    long_tailed_cu_seqlens,
    make_block_causal_mask,
    make_global_window_mask,
    make_prefix_lm_mask,
    make_shared_question_mask,
    make_sliding_window_mask,
    make_varlen_causal_mask,
    make_varlen_full_mask,
)
from .choice import DispatchChoice, default_chunk_size
from .comm import GroupCastArgs, GroupReduceArgs
from .cost_model import PROFILES, CostProfile, OverlapCostModel, get_profile, gpu_kind, load_profile
from .dispatch import DispatchAlg, DispatchPlan, dispatch_lower_bound, padded_seqlen, solve_dispatch
from .kv_layout import KVLayout
from .mask import AttnMaskType, AttnSlice, SliceList
from .overlap import OverlapMode, estimate_cost_factors, predicted_time
from .plan import (
    DistAttnPlan,
    PlanOptions,
    RankPlan,
    StagePlan,
    dispatch_choice,
    plan_attention,
    plan_dist_attn,
    plan_with_options,
)
from .ranges import AttnRange, AttnRanges

__version__ = "0.1.0"  # the [project] version of pyproject.toml (CI checks that they agree)

__all__ = [
    "PROFILES",
    "AttnMaskType",
    "AttnRange",
    "AttnRanges",
    "AttnSlice",
    "CostProfile",
    "DispatchAlg",
    "DispatchChoice",
    "DispatchPlan",
    "DistAttnPlan",
    "GroupCastArgs",
    "GroupReduceArgs",
    "KVLayout",
    "MaskSpec",
    "OverlapCostModel",
    "OverlapMode",
    "PlanOptions",
    "RankPlan",
    "SliceList",
    "StagePlan",
    "default_chunk_size",
    "dispatch_choice",
    "dispatch_lower_bound",
    "estimate_cost_factors",
    "get_profile",
    "gpu_kind",
    "load_profile",
    "long_tailed_cu_seqlens",
    "make_block_causal_mask",
    "make_global_window_mask",
    "make_prefix_lm_mask",
    "make_shared_question_mask",
    "make_sliding_window_mask",
    "make_varlen_causal_mask",
    "make_varlen_full_mask",
    "padded_seqlen",
    "plan_attention",
    "plan_dist_attn",
    "plan_with_options",
    "predicted_time",
    "solve_dispatch",
]
