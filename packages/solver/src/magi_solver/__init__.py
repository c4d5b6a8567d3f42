"""magi_solver: pure-Python planning for distributed attention (no torch).

Mask algebra (`AttnRange`, `AttnRanges`, `AttnMaskType`, `AttnSlice`), mask builders, the dispatch solver
(`solve_dispatch`), and the full plan (`plan_attention`, the one door to the planner, which also chooses
the chunk size per mask): per-rank host/remote slices, GroupCast/GroupReduce arguments and overlap stages, with the overlap degree priced by a cost model (`OverlapCostModel`, `CostProfile`,
`get_profile`).
"""

# Four modules are exported whole (their ``__all__`` is the list); from the others, the names below.
from . import builders, cost_model, kv_layout, plan
from .builders import *  # noqa: F403
from .choice import DispatchChoice, default_chunk_size
from .comm import GroupCastArgs, GroupReduceArgs
from .cost_model import *  # noqa: F403
from .dispatch import DispatchAlg, DispatchPlan, dispatch_lower_bound, padded_seqlen, solve_dispatch
from .kv_layout import *  # noqa: F403
from .mask import AttnMaskType, AttnSlice, SliceList
from .overlap import OverlapMode, estimate_cost_factors, predicted_time
from .plan import *  # noqa: F403
from .ranges import AttnRange, AttnRanges

__version__ = "0.1.0"  # the [project] version of pyproject.toml (CI checks that they agree)

__all__ = [
    *plan.__all__,
    *builders.__all__,
    *cost_model.__all__,
    *kv_layout.__all__,
    "AttnMaskType",
    "AttnRange",
    "AttnRanges",
    "AttnSlice",
    "DispatchAlg",
    "DispatchChoice",
    "DispatchPlan",
    "GroupCastArgs",
    "GroupReduceArgs",
    "OverlapMode",
    "SliceList",
    "default_chunk_size",
    "dispatch_lower_bound",
    "estimate_cost_factors",
    "padded_seqlen",
    "predicted_time",
    "solve_dispatch",
]
