"""The planner's types: how a mask is planned (`PlanOptions`) and what a plan is: per rank its host slices, its remote stages (the K/V each stage
fetches, with the GroupCast/GroupReduce arguments) and the slices of every stage; built by `plan_attention`.

Coordinates:
* local: a rank's tokens in local order (its chunks in ascending chunk id), `0 .. shard_seqlen`.
* recv buffer of stage i: the remote keys of that stage, ordered by source rank, then by the source's
  local order (the order `group_cast` delivers them).
* merged: `cat([local_kv] + [recv buffer of every stage, in stage order])`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .choice import DispatchChoice
from .comm import GroupCastArgs, GroupReduceArgs
from .cost_model import OverlapCostModel
from .dispatch import DispatchAlg, DispatchPlan
from .kv_layout import KVLayout
from .mask import SliceList
from .overlap import OverlapMode
from .ranges import AttnRanges, _check_int

__all__ = ["DistAttnPlan", "PlanOptions", "RankPlan", "StagePlan"]


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


def _parse_alg(value: Any) -> DispatchAlg | None:
    """`value` as a `DispatchAlg` (its value or the member), or None."""
    if value is None:
        return None
    try:
        return DispatchAlg(value)
    except ValueError:
        raise ValueError(
            f"`dispatch_alg` must be one of {[a.value for a in DispatchAlg]} or None, got {value!r}"
        ) from None


def _check_uneven(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`uneven_shard` must be a bool, got {type(value).__name__}")
    return value


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
    """How a mask is planned, apart from the mask and the sequence geometry; checked once, when built
    (`ValueError` or `TypeError` naming the field), enums given as members or their values.

    A `None` `overlap_degree` makes `overlap_mode` dynamic; `cost_model` None prices schedules with the cost
    factors.
    """

    dispatch_alg: DispatchAlg | str | None = DispatchAlg.MIN_HEAP
    """A `DispatchAlg`; None: the choice's algorithm when the chunk size is chosen, else min_heap. Ignored
    when a dispatch is given."""
    overlap_degree: int | None = 1
    """0 = one merged stage (all remote K/V at once); N >= 1 = N remote stages; None = dynamic."""
    overlap_mode: OverlapMode | str = OverlapMode.STATIC
    """"static" (use `overlap_degree`) or "dynamic" (the degree in 0..`dynamic_max_degree` minimising the
    slowest rank's predicted time; ties go to the smaller degree)."""
    min_chunk_size: int = 512
    """Smallest overlap chunk: remote K/V is cut into overlap chunks before they are grouped into stages."""
    max_num_chunks: int = 64
    """Most overlap chunks per rank."""
    dynamic_max_degree: int = 8
    """Largest degree the dynamic mode considers."""
    calc_cost_factor: float = 1.0
    """Cost per mask pair of the factor-only estimate (see `estimate_cost_factors`), used when
    `cost_model` is None; only its ratio to `comm_cost_factor` matters."""
    comm_cost_factor: float = 1.0
    """Cost per remote K/V token of the factor-only estimate."""
    cost_model: OverlapCostModel | None = None
    """Price schedules in seconds of forward + backward with this model (fixed per-stage, merge and
    collective costs included) instead of the cost factors."""
    uneven_shard: bool = False
    """The sequences are not padded: any length with at least `cp_size` chunks; the last chunk may be short
    and ranks hold slightly different token counts (`DispatchPlan.shard_seqlens`). A given dispatch must
    have been made the same way."""

    def __post_init__(self) -> None:
        alg = _parse_alg(self.dispatch_alg)
        _check_uneven(self.uneven_shard)
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
        # frozen: the checked, normalised values replace the given ones once, while it is built
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
