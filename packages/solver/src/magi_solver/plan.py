"""The full distributed-attention plan: dispatch, then per rank the host slices, the remote K/V it must fetch
(stage by stage) with the GroupCast/GroupReduce arguments, and the slices of every stage.

Coordinates:
* local: a rank's tokens in local order (its chunks in ascending chunk id), `0 .. shard_seqlen`.
* recv buffer of stage i: the remote keys of that stage, ordered by source rank, then by the source's
  local order (the order `group_cast` delivers them).
* merged: `cat([local_kv] + [recv buffer of every stage, in stage order])`.

Invariant (tested densely): every (q, k) pair of the mask is computed exactly once, by the rank owning q,
either in `host_slices` or in exactly one stage's `remote_slices` (and exactly once in `merged_slices`);
each stage fetches only keys the rank's rows need and does not hold (zero redundancy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._slicing import clip_rows, host_area_of, merge_full, slice_over
from .choice import DispatchChoice, choose_dispatch, default_chunk_size, predicted_choice_times
from .comm import GroupCastArgs, GroupReduceArgs, build_cast_args
from .cost_model import OverlapCostModel
from .dispatch import DispatchAlg, DispatchPlan, padded_seqlen, redispatch_areas, validate_geometry
from .kernel_law import law_for_mask
from .kv_layout import KVLayout
from .mask import SliceList, normalize_mask, total_area
from .overlap import FactorCostModel, OverlapMode, cut_tokens, stage_layouts
from .pricing import price_plan
from .ranges import AttnRange, AttnRanges, _check_int, _check_positive, merge_pairs, subtract_pairs

__all__ = [
    "DistAttnPlan",
    "PlanOptions",
    "RankPlan",
    "StagePlan",
    "dispatch_choice",
    "plan_attention",
    "plan_dist_attn",
    "plan_with_options",
]


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One remote stage of one rank.

    Attributes:
        cast: this rank's GroupCast args (input: local K/V; output: this stage's recv buffer).
        reduce: `cast.transpose()`, for the partial dK/dV of the recv buffer.
        num_remote_tokens: tokens in the recv buffer.
        remote_k_ranges: global key ranges held in the recv buffer, in buffer order.
        remote_slices: q in local coordinates, k in recv-buffer coordinates.
        area: exact mask area of `remote_slices`.
    """

    cast: GroupCastArgs
    reduce: GroupReduceArgs
    num_remote_tokens: int
    remote_k_ranges: AttnRanges
    remote_slices: SliceList
    area: int


@dataclass(frozen=True, slots=True)
class RankPlan:
    """Everything one rank runs.

    Attributes:
        rank: the rank.
        host_token_ranges: global ranges of the local tokens, in local order.
        host_slices: q and k in local coordinates (local K/V: the local tokens in self-attention, the
            rank's K/V shard in cross-attention).
        stages: `num_stages` remote stages (empty ones where this rank has less remote work).
        merged_slices: q local, k in coordinates of `cat([local_kv] + [stage recv buffers in order])`.
        host_area: exact mask area of `host_slices`.
    """

    rank: int
    host_token_ranges: AttnRanges
    host_slices: SliceList
    stages: tuple[StagePlan, ...]
    merged_slices: SliceList
    host_area: int

    @property
    def local_seqlen(self) -> int:
        return self.host_token_ranges.total_seqlen

    @property
    def num_remote_tokens(self) -> int:
        return sum(s.num_remote_tokens for s in self.stages)

    @property
    def area(self) -> int:
        return self.host_area + sum(s.area for s in self.stages)


@dataclass(frozen=True, slots=True)
class DistAttnPlan:
    """The plan of every rank (a pure function of the mask and config: every rank computes the same one).

    Attributes:
        dispatch: the chunk assignment.
        ranks: per rank its `RankPlan`.
        num_stages: remote stages per rank (1 for degree 0, the merged stage).
        overlap_degree: the degree used (0 = merged; chosen by the cost model in dynamic mode).
        predicted_times: per rank, the cost model's time of the chosen schedule: seconds of forward +
            backward with an `OverlapCostModel`, else the factor-only forward estimate (`FactorCostModel`)
            in the units of the cost factors.
        degree_costs: per candidate degree (only the chosen one in static mode), the slowest rank's
            predicted time, in the same units. Not part of the hash.
    """

    dispatch: DispatchPlan
    ranks: tuple[RankPlan, ...]
    num_stages: int
    overlap_degree: int = 1
    predicted_times: tuple[float, ...] = ()
    degree_costs: dict[int, float] = field(default_factory=dict, hash=False)
    kv_layout: KVLayout | None = None
    """Cross-attention: where keys and values live (None: with the queries, self-attention)."""
    choice: DispatchChoice | None = field(default=None, compare=False, hash=False)
    """How the chunk size and algorithm were chosen, with this plan's overlap degree and remote K/V."""

    @property
    def cp_size(self) -> int:
        return self.dispatch.cp_size

    @property
    def rank_areas(self) -> tuple[int, ...]:
        return tuple(r.area for r in self.ranks)

    @property
    def imbalance(self) -> float:
        return self.dispatch.imbalance

    @property
    def remote_tokens_per_rank(self) -> tuple[int, ...]:
        """K/V tokens each rank fetches (sum over stages; GroupReduce returns as many dK/dV rows)."""
        return tuple(r.num_remote_tokens for r in self.ranks)

    @property
    def ring_remote_tokens_per_rank(self) -> tuple[int, ...]:
        """K/V tokens a ring (zigzag or not) passes through each rank: every other rank's shard."""
        return tuple(self.dispatch.total_seqlen - n for n in self.dispatch.shard_seqlens)

    @property
    def all_gather_remote_tokens_per_rank(self) -> tuple[int, ...]:
        """K/V tokens an all-gather of K/V brings to each rank (the same count as a ring)."""
        return self.ring_remote_tokens_per_rank

    def transfer_matrix(self, stage: int) -> np.ndarray:
        """int64 `[cp, cp]`: tokens rank `src` (row) sends to rank `dst` (column) in `stage`."""
        m = np.zeros((self.cp_size, self.cp_size), dtype=np.int64)
        for dst, rp in enumerate(self.ranks):
            a = rp.stages[stage].cast
            for n, src in zip(a.output_split_sizes, a.src_index):
                m[src, dst] += n
        return m

    def summary(self) -> dict[str, Any]:
        """Balance and communication in one dict (used by the demo and the benchmark)."""
        remote = self.remote_tokens_per_rank
        ring = max(self.ring_remote_tokens_per_rank)
        return {
            "cp_size": self.cp_size,
            "num_stages": self.num_stages,
            "overlap_degree": self.overlap_degree,
            "imbalance": self.imbalance,
            "lower_bound_imbalance": self.dispatch.lower_bound_imbalance,
            "remote_tokens_max": max(remote),
            "remote_tokens_mean": sum(remote) / len(remote),
            "ring_tokens": ring,
            "all_gather_tokens": max(self.all_gather_remote_tokens_per_rank),
            "remote_vs_ring": max(remote) / ring if ring else 0.0,
            "num_slices_max": max(
                len(r.host_slices) + sum(len(s.remote_slices) for s in r.stages) for r in self.ranks
            ),
        }


def _validate_overlap(
    overlap_degree: Any,
    overlap_mode: Any,
    min_chunk_size: Any,
    max_num_chunks: Any,
    dynamic_max_degree: Any,
    calc_cost_factor: Any,
    comm_cost_factor: Any,
) -> tuple[int | None, OverlapMode]:
    try:
        mode = OverlapMode(overlap_mode)
    except ValueError:
        raise ValueError(
            f"`overlap_mode` must be one of {[m.value for m in OverlapMode]}, got {overlap_mode!r}"
        ) from None
    if overlap_degree is not None:
        overlap_degree = _check_int(overlap_degree, "overlap_degree")
        if overlap_degree < 0:
            raise ValueError(
                f"`overlap_degree` must be >= 0 (0 = one merged stage) or None, got {overlap_degree}"
            )
    for name, v in (
        ("min_chunk_size", min_chunk_size),
        ("max_num_chunks", max_num_chunks),
        ("dynamic_max_degree", dynamic_max_degree),
    ):
        if _check_int(v, name) < 1:
            raise ValueError(f"`{name}` must be >= 1, got {v}")
    for name, v in (("calc_cost_factor", calc_cost_factor), ("comm_cost_factor", comm_cost_factor)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"`{name}` must be a finite number >= 0, got {v!r}")
    if overlap_degree is None:
        mode = OverlapMode.DYNAMIC
    return overlap_degree, mode


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """How a mask is planned, apart from the mask and the sequence geometry; checked once, when built.

    The fields are `plan_dist_attn`'s keyword arguments of the same names (see there). A `None`
    `overlap_degree` makes `overlap_mode` dynamic; `cost_model` None prices schedules with the cost factors.
    """

    dispatch_alg: DispatchAlg | str | None = DispatchAlg.MIN_HEAP
    """A `DispatchAlg`; None: the choice's algorithm when the chunk size is chosen, else min_heap."""
    overlap_degree: int | None = 1
    overlap_mode: OverlapMode | str = OverlapMode.STATIC
    min_chunk_size: int = 512
    max_num_chunks: int = 64
    dynamic_max_degree: int = 8
    calc_cost_factor: float = 1.0
    comm_cost_factor: float = 1.0
    cost_model: OverlapCostModel | None = None
    uneven_shard: bool = False

    def __post_init__(self) -> None:
        alg = self.dispatch_alg
        if alg is not None:
            try:
                alg = DispatchAlg(alg)
            except ValueError:
                raise ValueError(
                    f"`dispatch_alg` must be one of {[a.value for a in DispatchAlg]} or None, got {alg!r}"
                ) from None
        if not isinstance(self.uneven_shard, bool):
            raise TypeError(f"`uneven_shard` must be a bool, got {type(self.uneven_shard).__name__}")
        if self.cost_model is not None and not isinstance(self.cost_model, OverlapCostModel):
            raise TypeError(
                f"`cost_model` must be an OverlapCostModel or None, got {type(self.cost_model).__name__}"
            )
        degree, mode = _validate_overlap(
            self.overlap_degree,
            self.overlap_mode,
            self.min_chunk_size,
            self.max_num_chunks,
            self.dynamic_max_degree,
            self.calc_cost_factor,
            self.comm_cost_factor,
        )
        # frozen: the checked, normalised values replace the given ones once, here
        for name, value in (
            ("dispatch_alg", alg),
            ("overlap_degree", degree),
            ("overlap_mode", mode),
            ("min_chunk_size", int(self.min_chunk_size)),
            ("max_num_chunks", int(self.max_num_chunks)),
            ("dynamic_max_degree", int(self.dynamic_max_degree)),
            ("calc_cost_factor", float(self.calc_cost_factor)),
            ("comm_cost_factor", float(self.comm_cost_factor)),
        ):
            object.__setattr__(self, name, value)


def plan_dist_attn(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    chunk_size: int,
    *,
    dispatch_alg: str = "min_heap",
    overlap_degree: int | None = 1,
    overlap_mode: str = "static",
    min_chunk_size: int = 512,
    max_num_chunks: int = 64,
    dynamic_max_degree: int = 8,
    calc_cost_factor: float = 1.0,
    comm_cost_factor: float = 1.0,
    dispatch: DispatchPlan | None = None,
    cost_model: OverlapCostModel | None = None,
    total_seqlen_k: int | None = None,
    kv_chunk_size: int | None = None,
    uneven_shard: bool = False,
) -> DistAttnPlan:
    """Plan attention with context parallelism over `cp_size` ranks (a pure function): a thin wrapper over
    `plan_attention` (the one planning path) for callers that give the padded geometry and every option as
    a keyword; new code calls `plan_attention`, which also chooses the chunk size.

    Self-attention by default (queries and keys are one sequence, dispatched together); with
    `total_seqlen_k` (cross-attention: keys and values from another sequence) the queries are dispatched by
    mask area and the keys and values are split into contiguous equal shards (`KVLayout`), and each rank
    fetches only the keys its queries need.

    Args:
        q_ranges, k_ranges, attn_mask_type: the mask, as in `solve_dispatch`.
        total_seqlen: tokens of the padded sequence; a multiple of `chunk_size * cp_size`.
        cp_size: number of ranks.
        chunk_size: dispatch chunk size in tokens.
        dispatch_alg: a `DispatchAlg` value.
        overlap_degree: 0 = one merged stage (all remote K/V at once); N >= 1 = N remote stages;
            None = dynamic.
        overlap_mode: "static" (use `overlap_degree`) or "dynamic" (the degree in 0..`dynamic_max_degree`
            minimising the slowest rank's predicted time; ties go to the smaller degree).
        min_chunk_size, max_num_chunks: how remote K/V is cut into overlap chunks before grouping into stages.
        calc_cost_factor, comm_cost_factor: cost per mask pair and per remote token (see
            `estimate_cost_factors`) of the factor-only estimate used when `cost_model` is None; only their
            ratio matters.
        dispatch: reuse this chunk assignment instead of solving one (for a mask built after dispatch: the
            tokens stay where they are); its sizes must match, and `dispatch_alg` is then ignored.
        cost_model: price schedules in seconds of forward + backward with this model (fixed per-stage,
            merge and collective costs included) instead of the cost factors.
        total_seqlen_k: cross-attention: tokens of the padded key/value sequence (a multiple of
            `kv_chunk_size * cp_size`); None = self-attention. `k_ranges` then index this sequence.
        kv_chunk_size: cross-attention: key/value chunk size (default `chunk_size`).
        uneven_shard: the sequences are not padded: `total_seqlen` (and `total_seqlen_k`) may be any length
            with at least `cp_size` chunks; the last chunk may be short and ranks hold slightly different
            token counts (`DispatchPlan.shard_seqlens`). A given `dispatch` must have been made the same way.

    Returns:
        A `DistAttnPlan`; every rank has `num_stages` stages. Raises `ValueError` on bad input.
    """
    options = PlanOptions(
        dispatch_alg=dispatch_alg,
        overlap_degree=overlap_degree,
        overlap_mode=overlap_mode,
        min_chunk_size=min_chunk_size,
        max_num_chunks=max_num_chunks,
        dynamic_max_degree=dynamic_max_degree,
        calc_cost_factor=calc_cost_factor,
        comm_cost_factor=comm_cost_factor,
        cost_model=cost_model,
        uneven_shard=uneven_shard,
    )
    # this wrapper's contract: the geometry is already padded (plan_attention would pad it)
    total_seqlen, cp_size, chunk_size = validate_geometry(
        total_seqlen, cp_size, chunk_size, uneven_shard=uneven_shard
    )
    kv_layout = None
    if total_seqlen_k is not None:
        kv_layout = KVLayout(
            total_seqlen_k, cp_size, chunk_size if kv_chunk_size is None else kv_chunk_size, uneven_shard
        )
    elif kv_chunk_size is not None:
        raise ValueError("`kv_chunk_size` is for cross-attention: give `total_seqlen_k` too")
    return plan_attention(
        q_ranges, k_ranges, attn_mask_type, total_seqlen, cp_size,
        chunk_size=chunk_size, options=options, kv_layout=kv_layout, dispatch=dispatch,
    )  # fmt: skip


def plan_with_options(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    chunk_size: int,
    options: PlanOptions,
    *,
    kv_layout: KVLayout | None = None,
    dispatch: DispatchPlan | None = None,
) -> DistAttnPlan:
    """`plan_attention` with a positional, explicit chunk size (kept for earlier callers)."""
    return plan_attention(
        q_ranges, k_ranges, attn_mask_type, total_seqlen, cp_size,
        chunk_size=chunk_size, options=options, kv_layout=kv_layout, dispatch=dispatch,
    )  # fmt: skip


def dispatch_choice(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    *,
    chunk_size: int | None = None,
    dispatch_alg: DispatchAlg | str | None = None,
    uneven_shard: bool = False,
    total_seqlen_k: int | None = None,
) -> tuple[DispatchChoice, DispatchPlan]:
    """The dispatch step of `plan_attention` on its own (the runtime's layout calls it before the kernel
    backend, which prices the overlap, is known): the chosen (or given) chunk size and algorithm and the
    solved `DispatchPlan`, cached per mask, geometry and request, so `plan_attention` reuses it.

    Args:
        q_ranges, k_ranges, attn_mask_type: the mask, as in `solve_dispatch`, over `total_seqlen` queries.
        total_seqlen: query tokens *before* padding; the plan pads to a multiple of `chunk_size * cp_size`
            (the dispatch's `total_seqlen` is the padded length), unless `uneven_shard`.
        cp_size: ranks.
        chunk_size: tokens per chunk; None chooses it per mask and cp size (`magi_solver.choice`).
        dispatch_alg: a `DispatchAlg`; None: chosen with the chunk size (min_heap with an explicit one).
        uneven_shard: no padding; ranks' token counts may differ by one chunk.
        total_seqlen_k: cross-attention: the key sequence's length (`k_ranges` index it); None: self.

    Returns:
        `(choice, dispatch)`; `choice.overlap_degree` is -1 until a plan is built.
    """
    choice, dispatch, _ = _dispatch_choice(
        q_ranges, k_ranges, attn_mask_type, total_seqlen, cp_size, chunk_size, dispatch_alg, uneven_shard,
        total_seqlen_k,
    )  # fmt: skip
    return choice, dispatch


def _dispatch_choice(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: Any,
    cp_size: Any,
    chunk_size: Any,
    dispatch_alg: Any,
    uneven_shard: Any,
    total_seqlen_k: Any,
) -> tuple[DispatchChoice, DispatchPlan, list[tuple[int, int, int, int, int]]]:
    """`dispatch_choice`, also returning the validated slices."""
    total_seqlen = _check_positive(total_seqlen, "total_seqlen")
    cp_size = _check_positive(cp_size, "cp_size")
    if chunk_size is not None and _check_int(chunk_size, "chunk_size") <= 0:
        raise ValueError(f"`chunk_size` must be positive or None, got {chunk_size}")
    if not isinstance(uneven_shard, bool):
        raise TypeError(f"`uneven_shard` must be a bool, got {type(uneven_shard).__name__}")
    if dispatch_alg is not None:
        try:
            dispatch_alg = DispatchAlg(dispatch_alg)
        except ValueError:
            raise ValueError(
                f"`dispatch_alg` must be one of {[a.value for a in DispatchAlg]} or None, got {dispatch_alg!r}"
            ) from None
    cross = total_seqlen_k is not None
    if cross and dispatch_alg in (DispatchAlg.AFFINITY, DispatchAlg.DOCUMENTS):
        raise ValueError(
            f"dispatch_alg={dispatch_alg.value!r} pairs query and key chunks of one sequence: not for "
            "cross-attention"
        )
    total_k = total_seqlen if total_seqlen_k is None else _check_int(total_seqlen_k, "total_seqlen_k")
    slices = normalize_mask(q_ranges, k_ranges, attn_mask_type, total_seqlen, total_k)
    if chunk_size is not None:  # a named error for a geometry that cannot hold cp chunks
        padded = total_seqlen if uneven_shard else padded_seqlen(total_seqlen, cp_size, chunk_size)
        validate_geometry(padded, cp_size, chunk_size, uneven_shard=uneven_shard)
    choice, dispatch = choose_dispatch(
        slices,
        total_seqlen,
        cp_size,
        chunk_size=chunk_size,
        alg=dispatch_alg,
        uneven_shard=uneven_shard,
        cross_attention=cross,
    )
    return choice, dispatch, slices


def plan_attention(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    *,
    chunk_size: int | None = None,
    options: PlanOptions | None = None,
    kv_layout: KVLayout | None = None,
    total_seqlen_k: int | None = None,
    dispatch: DispatchPlan | None = None,
) -> DistAttnPlan:
    """Plan attention with context parallelism over `cp_size` ranks: the one planning path of the runtime,
    `magi-attention-plan`, `magi_solver.tools` and the benchmarks (a pure function, the same on every rank).

    Args:
        q_ranges, k_ranges, attn_mask_type: the mask (see `solve_dispatch`) over `total_seqlen` queries.
        total_seqlen: query tokens before padding; padded to a multiple of `chunk_size * cp_size` (the plan's
            `dispatch.total_seqlen`), unless `options.uneven_shard`.
        cp_size: ranks.
        chunk_size: tokens per dispatch chunk; None chooses it (and, with `options.dispatch_alg` None, the
            algorithm) per mask and cp size from the balance lower bound, the tile-fill cost of fragments and
            the remote K/V of the busiest rank (`magi_solver.choice`). An explicit size is always used.
        options: overlap and dispatch options (default `PlanOptions(dispatch_alg=None)`: chosen).
        kv_layout: cross-attention: where keys and values live (`KVLayout`, `cp_size` ranks).
        total_seqlen_k: cross-attention without a `kv_layout`: the key sequence's length (before padding);
            it is split into contiguous shards of `default_chunk_size(total_seqlen_k, cp_size)` chunks.
        dispatch: reuse this chunk assignment (a mask built after dispatch keeps its tokens where they are);
            its geometry must be this plan's.

    Returns:
        A `DistAttnPlan` whose `choice` says which chunk size and algorithm, and why.
    """
    if options is None:
        options = PlanOptions(dispatch_alg=None)
    elif not isinstance(options, PlanOptions):
        raise TypeError(f"`options` must be a PlanOptions, got {type(options).__name__}")
    uneven = options.uneven_shard
    cp_size = _check_int(cp_size, "cp_size")
    if kv_layout is None and total_seqlen_k is not None:
        tk = _check_int(total_seqlen_k, "total_seqlen_k")
        if tk <= 0 or cp_size <= 0:
            raise ValueError(f"`total_seqlen_k` and `cp_size` must be positive, got {tk}, {cp_size}")
        kc = default_chunk_size(tk, cp_size)
        kv_layout = KVLayout(tk if uneven else padded_seqlen(tk, cp_size, kc), cp_size, kc, uneven)
    if kv_layout is not None:
        if not isinstance(kv_layout, KVLayout):
            raise TypeError(f"`kv_layout` must be a KVLayout or None, got {type(kv_layout).__name__}")
        if (kv_layout.cp_size, kv_layout.uneven_shard) != (cp_size, uneven):
            raise ValueError(
                f"`kv_layout` has (cp_size, uneven_shard) = {(kv_layout.cp_size, kv_layout.uneven_shard)}, "
                f"the plan {(cp_size, uneven)}"
            )
        if options.dispatch_alg in (DispatchAlg.AFFINITY, DispatchAlg.DOCUMENTS) and dispatch is None:
            raise ValueError(
                f"dispatch_alg={options.dispatch_alg.value!r} pairs query and key chunks of one sequence: not "
                "for cross-attention"
            )
    total_k = None if kv_layout is None else kv_layout.total_seqlen
    if dispatch is None:
        choice, dispatch, slices = _dispatch_choice(
            q_ranges, k_ranges, attn_mask_type, total_seqlen, cp_size, chunk_size, options.dispatch_alg,
            uneven, total_k,
        )  # fmt: skip
    else:
        if not isinstance(dispatch, DispatchPlan):
            raise TypeError(f"`dispatch` must be a DispatchPlan or None, got {type(dispatch).__name__}")
        total_seqlen = _check_int(total_seqlen, "total_seqlen")
        cs = dispatch.chunk_size if chunk_size is None else _check_int(chunk_size, "chunk_size")
        padded = (
            total_seqlen if uneven or cs <= 0 or cp_size <= 0 else padded_seqlen(total_seqlen, cp_size, cs)
        )
        padded, cp_size, cs = validate_geometry(padded, cp_size, cs, uneven_shard=uneven)
        got = (dispatch.total_seqlen, dispatch.cp_size, dispatch.chunk_size, dispatch.uneven_shard)
        if got != (padded, cp_size, cs, uneven):
            raise ValueError(
                f"`dispatch` was made for (total_seqlen, cp_size, chunk_size, uneven_shard) = {got}, "
                f"not {(padded, cp_size, cs, uneven)}"
            )
        slices = normalize_mask(q_ranges, k_ranges, attn_mask_type, padded, total_k or padded)
        again = redispatch_areas(dispatch, slices)
        # the same mask's dispatch (the runtime's root key) is used as it is: solved once
        dispatch = dispatch if again.chunk_areas == dispatch.chunk_areas else again
        # this mask's own predicted times on the given placement (a derived key's, not its root's)
        price = price_plan(dispatch, slices, law_for_mask(slices, padded), cross=kv_layout is not None)
        choice = DispatchChoice(
            dispatch.chunk_size,
            dispatch.alg.value,
            -1,
            dispatch.imbalance,
            dispatch.lower_bound_imbalance,
            0,
            f"the dispatch of chunk {dispatch.chunk_size} ({dispatch.alg.value}) was given.",
            *predicted_choice_times(price),
        )
    plan = _plan(
        dispatch,
        slices,
        options.overlap_degree,
        options.overlap_mode,
        options.min_chunk_size,
        options.max_num_chunks,
        options.dynamic_max_degree,
        options.cost_model or FactorCostModel(options.calc_cost_factor, options.comm_cost_factor),
        kv_layout,
    )
    remote = max(plan.remote_tokens_per_rank)
    object.__setattr__(plan, "choice", choice.with_plan(plan.overlap_degree, remote))
    return plan


def _plan(
    dispatch: DispatchPlan,
    slices: list[tuple[int, int, int, int, int]],
    degree: int | None,
    mode: OverlapMode,
    min_chunk_size: int,
    max_num_chunks: int,
    dynamic_max_degree: int,
    cost: OverlapCostModel | FactorCostModel,
    kv_layout: KVLayout | None = None,
) -> DistAttnPlan:
    cp = dispatch.cp_size
    shards = dispatch.shard_seqlens  # local queries per rank (equal unless uneven shards)
    # where keys live: with the queries (self-attention) or in their own contiguous shards
    kv = dispatch if kv_layout is None else kv_layout
    cs, kv_shards, owner = kv.chunk_size, kv.shard_seqlens, kv.chunk_owner
    if kv_layout is None:
        local_pos = [0] * dispatch.num_chunks  # local offset of each chunk inside its owner
        for part in dispatch.partitions:
            for i, c in enumerate(part):
                local_pos[c] = i * cs
    else:
        local_pos = kv_layout.chunk_local_offsets()
    clipped = clip_rows(dispatch, slices)
    host = [kv.host_pairs(r) for r in range(cp)]
    remote = [subtract_pairs(merge_pairs((c[2], c[3]) for c in clipped[r]), host[r]) for r in range(cp)]

    # host areas feed the cost model; the key map sends host keys to destination -1 (local coordinates)
    host_maps = [_host_map(h) for h in host]
    host_area = [host_area_of(clipped[r], host_maps[r]) for r in range(cp)]
    candidates = list(range(dynamic_max_degree + 1)) if mode is OverlapMode.DYNAMIC else [degree or 0]
    layouts = [
        stage_layouts(remote[r], clipped[r], min_chunk_size, max_num_chunks, candidates) for r in range(cp)
    ]
    times = {
        d: [
            cost.total_time(d, host_area[r], layouts[r][d].areas, layouts[r][d].tokens, shards[r])
            for r in range(cp)
        ]
        for d in candidates
    }
    # one degree for every rank: the one whose slowest rank is fastest (ties: the smaller degree)
    degree_costs = {d: max(t) for d, t in times.items()}
    chosen = min(candidates, key=lambda d: (degree_costs[d], d))
    num_stages = max(chosen, 1)
    stage_ranges = [cut_tokens(remote[r], layouts[r][chosen].token_bounds) for r in range(cp)]
    runs = [
        [_recv_runs(stage_ranges[r][si], owner, local_pos, cs) for r in range(cp)] for si in range(num_stages)
    ]
    cast_args = [_cast_args(runs[si], cp, kv_shards) for si in range(num_stages)]
    ranks = [
        _rank_plan(
            dispatch,
            r,
            clipped[r],
            host_maps[r],
            host_area[r],
            [runs[si][r] for si in range(num_stages)],
            [cast_args[si][r] for si in range(num_stages)],
            kv_shards[r],
        )
        for r in range(cp)
    ]
    return DistAttnPlan(
        dispatch=dispatch,
        ranks=tuple(ranks),
        num_stages=num_stages,
        overlap_degree=chosen,
        predicted_times=tuple(times[chosen]),
        degree_costs=degree_costs,
        kv_layout=kv_layout,
    )


def _host_map(host: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """Key-map entries (global start, global end, -1, local base) of a rank's own tokens."""
    out, base = [], 0
    for a, b in host:
        out.append((a, b, -1, base))
        base += b - a
    return out


def _recv_runs(
    ranges: list[tuple[int, int]], owner: tuple[int, ...], local_pos: list[int], cs: int
) -> list[tuple[int, int, int, int]]:
    """A stage's remote keys as runs (global start, global end, source rank, source-local start) in recv
    buffer order: by source rank, then by the source's local order. A run never crosses a chunk its source
    does not hold contiguously."""
    pieces: list[tuple[int, int, int, int]] = []
    for s, e in ranges:
        while s < e:
            c = s // cs
            t = min(e, (c + 1) * cs)
            src, ls = owner[c], local_pos[c] + s - c * cs
            p = pieces[-1] if pieces else None
            if p and p[2] == src and p[1] == s and p[3] + (p[1] - p[0]) == ls:
                pieces[-1] = (p[0], t, src, p[3])
            else:
                pieces.append((s, t, src, ls))
            s = t
    pieces.sort(key=lambda p: (p[2], p[3]))
    return pieces


def _cast_args(
    runs: list[list[tuple[int, int, int, int]]], cp: int, shards: tuple[int, ...]
) -> list[GroupCastArgs]:
    """GroupCast args of every rank for one stage, from every receiver's runs (`shards`: each rank's
    local K/V tokens)."""
    wants: list[list[list[tuple[int, int]]]] = [[[] for _ in range(cp)] for _ in range(cp)]
    for dst in range(cp):
        for s, e, src, ls in runs[dst]:
            w = wants[dst][src]
            if w and w[-1][1] == ls:
                w[-1] = (w[-1][0], ls + e - s)
            else:
                w.append((ls, ls + e - s))
    return build_cast_args(wants, shards)


def _key_map(
    host_map: list[tuple[int, int, int, int]], runs: list[list[tuple[int, int, int, int]]]
) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """Where a rank's keys live: entries (global start, global end, stage or -1 for its own, base in that
    buffer) sorted by global start, and the tokens of each stage's recv buffer."""
    kmap, bufs = list(host_map), []
    for si, stage_runs in enumerate(runs):
        base = 0
        for s, e, _, _ in stage_runs:
            kmap.append((s, e, si, base))
            base += e - s
        bufs.append(base)
    kmap.sort()
    return kmap, bufs


def _rank_plan(
    dispatch: DispatchPlan,
    rank: int,
    clipped: list[tuple[int, ...]],
    host_map: list[tuple[int, int, int, int]],
    host_area: int,
    runs: list[list[tuple[int, int, int, int]]],
    casts: list[GroupCastArgs],
    kv_shard: int,
) -> RankPlan:
    """Cut the rank's clipped slices by host keys and every stage's recv buffer; assemble its RankPlan."""
    num_stages = len(runs)
    kmap, bufs = _key_map(host_map, runs)
    out: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(num_stages + 1)]
    slice_over(clipped, kmap, out)
    host_sl = merge_full(out[num_stages])
    merged = list(host_sl)
    offset = kv_shard  # merged K/V = cat([local K/V] + recv buffers)
    stages = []
    for si in range(num_stages):
        sl = merge_full(out[si])
        merged.extend((a, b, c + offset, d + offset, t) for a, b, c, d, t in sl)
        offset += bufs[si]
        stages.append(
            StagePlan(
                cast=casts[si],
                reduce=casts[si].transpose(),
                num_remote_tokens=bufs[si],
                remote_k_ranges=AttnRanges(tuple(AttnRange._trusted(s, e) for s, e, _, _ in runs[si])),
                remote_slices=SliceList.from_typed(sl),
                area=total_area(sl),
            )
        )
    return RankPlan(
        rank=rank,
        host_token_ranges=dispatch.host_token_ranges(rank),
        host_slices=SliceList.from_typed(host_sl),
        stages=tuple(stages),
        merged_slices=SliceList.from_typed(merge_full(merged)),
        host_area=host_area,
    )
