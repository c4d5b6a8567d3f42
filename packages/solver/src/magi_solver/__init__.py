"""magi_solver: pure-Python planning for distributed attention (no torch).

Mask algebra (`AttnRange`, `AttnRanges`, `AttnMaskType`, `AttnSlice`), mask builders, the dispatch solver
(`solve_dispatch`), and the full plan (`plan_dist_attn`): per-rank host/remote slices, GroupCast/GroupReduce
arguments and overlap stages.
"""

from .builders import (
    MaskSpec,
    make_block_causal_mask,
    make_global_window_mask,
    make_prefix_lm_mask,
    make_shared_question_mask,
    make_sliding_window_mask,
    make_varlen_causal_mask,
    make_varlen_full_mask,
)
from .comm import GroupCastArgs, GroupReduceArgs
from .dispatch import DispatchAlg, DispatchPlan, dispatch_lower_bound, solve_dispatch
from .mask import AttnMaskType, AttnSlice, SliceList
from .overlap import OverlapMode, estimate_cost_factors, predicted_time
from .plan import DistAttnPlan, RankPlan, StagePlan, plan_dist_attn
from .ranges import AttnRange, AttnRanges

__all__ = [
    "AttnMaskType",
    "AttnRange",
    "AttnRanges",
    "AttnSlice",
    "DispatchAlg",
    "DispatchPlan",
    "DistAttnPlan",
    "GroupCastArgs",
    "GroupReduceArgs",
    "MaskSpec",
    "OverlapMode",
    "RankPlan",
    "SliceList",
    "StagePlan",
    "dispatch_lower_bound",
    "estimate_cost_factors",
    "make_block_causal_mask",
    "make_global_window_mask",
    "make_prefix_lm_mask",
    "make_shared_question_mask",
    "make_sliding_window_mask",
    "make_varlen_causal_mask",
    "make_varlen_full_mask",
    "plan_dist_attn",
    "predicted_time",
    "solve_dispatch",
]
