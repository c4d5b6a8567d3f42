"""What a distributed-attention plan is: per rank its host slices, its remote stages (the K/V each stage
fetches, with the GroupCast/GroupReduce arguments) and the slices of every stage; built by `plan_attention`.

Coordinates:
* local: a rank's tokens in local order (its chunks in ascending chunk id), `0 .. shard_seqlen`.
* recv buffer of stage i: the remote keys of that stage, ordered by source rank, then by the source's
  local order (the order `group_cast` delivers them).
* merged: `cat([local_kv] + [recv buffer of every stage, in stage order])`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .choice import DispatchChoice
from .comm import GroupCastArgs, GroupReduceArgs
from .dispatch import DispatchPlan
from .kv_layout import KVLayout
from .mask import SliceList
from .ranges import AttnRanges

__all__ = ["DistAttnPlan", "RankPlan", "StagePlan"]


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
