"""Overlap solver: split a rank's remote K/V into stages so fetching stage i+1 hides behind computing stage i.

Remote K/V (sorted global ranges) is cut into "overlap chunks" of `min_chunk_size` tokens (at most
`max_num_chunks` of them; larger chunks when there would be more). `degree` stages group the chunks
contiguously and near-equally (earlier stages take one chunk more); stages beyond the chunk count stay
empty. Degree 0 is one merged stage with all remote K/V (fetched at once, no overlap).

The planner prices each candidate degree with a cost model: `cost_model.OverlapCostModel` (seconds, forward
plus backward, fixed and merge costs included), or, without one, `FactorCostModel`: units are whatever the
factors make them, `calc = calc_cost_factor * area`, `comm = comm_cost_factor * tokens`, a `d`-stage
schedule costs `sum_{i<d} max(comm_i, calc_{i-1}) + calc_{d-1}` with `calc_{-1}` = host compute (stage i's
fetch runs while stage i-1, or the host stage, computes) and degree 0 costs all comm plus all compute.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from .mask import band_area_np

__all__ = [
    "FactorCostModel",
    "OverlapMode",
    "StageLayout",
    "cut_tokens",
    "estimate_cost_factors",
    "group_chunks",
    "overlap_chunk_bounds",
    "predicted_time",
    "stage_layouts",
    "stage_options",
]


class OverlapMode(StrEnum):
    """STATIC: the caller's degree. DYNAMIC: the degree in 0..dynamic_max_degree with the least predicted time
    (the slowest rank's; ties go to the smaller degree), identical for every rank."""

    STATIC = "static"
    DYNAMIC = "dynamic"


def overlap_chunk_bounds(num_tokens: int, min_chunk_size: int, max_num_chunks: int) -> list[int]:
    """Token offsets `[0, ..., num_tokens]` cutting `num_tokens` remote tokens into overlap chunks."""
    if num_tokens == 0:
        return [0]
    size = min_chunk_size
    if math.ceil(num_tokens / size) > max_num_chunks:
        size = math.ceil(num_tokens / max_num_chunks)
    return [*range(0, num_tokens, size), num_tokens]


def group_chunks(num_chunks: int, degree: int) -> list[int]:
    """Chunk-index boundaries of `degree` contiguous, near-equal groups (`degree + 1` numbers)."""
    base, extra = divmod(num_chunks, degree)
    bounds = [0]
    for i in range(degree):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def predicted_time(host_calc: float, comm: Sequence[float], calc: Sequence[float]) -> float:
    """Predicted time of a schedule: stage i's fetch overlaps stage i-1's compute (the host stage first)."""
    t, prev = 0.0, host_calc
    for c, a in zip(comm, calc):
        t += max(c, prev)
        prev = a
    return t + prev


def estimate_cost_factors(
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    *,
    tflops: float = 400.0,
    comm_gbps: float = 200.0,
    bytes_per_elem: int = 2,
    backward: bool = False,
) -> tuple[float, float]:
    """`(calc_cost_factor, comm_cost_factor)` in seconds per mask pair and per remote K/V token.

    Forward FLOPs per pair are `4 * num_heads_q * head_dim` (2.5x that in backward); a token moves K and V,
    `2 * num_heads_kv * head_dim * bytes_per_elem` bytes (backward also returns dK and dV: twice that).
    Defaults are H200-like (hundreds of dense bf16 TFLOP/s in an attention kernel, ~200 GB/s all-to-all).
    """
    flops = 4.0 * num_heads_q * head_dim * (2.5 if backward else 1.0)
    nbytes = 2.0 * num_heads_kv * head_dim * bytes_per_elem * (2.0 if backward else 1.0)
    return flops / (tflops * 1e12), nbytes / (comm_gbps * 1e9)


@dataclass(frozen=True, slots=True)
class StageLayout:
    """One rank's remote work cut into the stages of one degree.

    Attributes:
        token_bounds: stage boundaries as offsets into the rank's sorted remote tokens (`n + 1` numbers).
        areas: mask area of each stage (this rank's rows).
        tokens: remote K/V tokens of each stage.
    """

    token_bounds: list[int]
    areas: list[int]
    tokens: list[int]


def stage_layouts(
    remote: list[tuple[int, int]],
    clipped: list[tuple[int, ...]],
    min_chunk_size: int,
    max_num_chunks: int,
    candidates: Sequence[int],
) -> dict[int, StageLayout]:
    """For each candidate degree, how the rank's remote K/V splits into stages (degree 0: one merged stage
    with all of it)."""
    n_tok = sum(e - s for s, e in remote)
    bounds = overlap_chunk_bounds(n_tok, min_chunk_size, max_num_chunks)
    n_chunks = len(bounds) - 1
    chunk_area = overlap_chunk_areas(remote, bounds, clipped) if n_chunks else np.zeros(0, dtype=np.int64)
    ca = [0, *np.cumsum(chunk_area).tolist()]
    out = {}
    for d in candidates:
        g = [0, n_chunks] if d == 0 else group_chunks(n_chunks, d)
        tb = [bounds[i] for i in g]
        areas = [ca[g[i + 1]] - ca[g[i]] for i in range(len(g) - 1)]
        out[d] = StageLayout(tb, areas, [tb[i + 1] - tb[i] for i in range(len(g) - 1)])
    return out


@dataclass(frozen=True, slots=True)
class FactorCostModel:
    """The factor-only estimate (`calc = calc_f * area`, `comm = comm_f * tokens`, forward only, no fixed
    costs), in the units of the factors. Used when the planner is given no `OverlapCostModel`."""

    calc_f: float
    comm_f: float

    def total_time(
        self,
        degree: int,
        host_area: float,
        stage_areas: Sequence[float],
        stage_tokens: Sequence[float],
        local_q_tokens: float,
    ) -> float:
        """Degree 0: remote fetch then all compute in sequence; else `predicted_time` of the stages."""
        if degree == 0:
            return self.comm_f * sum(stage_tokens) + self.calc_f * (host_area + sum(stage_areas))
        return predicted_time(
            self.calc_f * host_area,
            [self.comm_f * t for t in stage_tokens],
            [self.calc_f * a for a in stage_areas],
        )


def stage_options(
    remote: list[tuple[int, int]],
    clipped: list[tuple[int, ...]],
    host_area: int,
    min_chunk_size: int,
    max_num_chunks: int,
    calc_f: float,
    comm_f: float,
    candidates: list[int],
) -> dict[int, tuple[list[int], float]]:
    """For each candidate degree: stage boundaries (offsets into the rank's sorted remote tokens) and the
    factor-only predicted time of that schedule (see `FactorCostModel`)."""
    model = FactorCostModel(calc_f, comm_f)
    return {
        d: (lay.token_bounds, model.total_time(d, host_area, lay.areas, lay.tokens, 0))
        for d, lay in stage_layouts(remote, clipped, min_chunk_size, max_num_chunks, candidates).items()
    }


def overlap_chunk_areas(
    remote: list[tuple[int, int]], bounds: list[int], clipped: list[tuple[int, ...]]
) -> np.ndarray:
    """Mask area (this rank's rows) of the keys of each overlap chunk (vectorised over region x piece)."""
    # the remote ranges cut at the chunk token bounds: pieces (global start, global end, chunk index)
    pieces = _pieces(remote, bounds)
    starts = [p[0] for p in pieces]
    ri, pi = [], []
    for i, r in enumerate(clipped):
        j = max(bisect.bisect_right(starts, r[2]) - 1, 0)
        while j < len(pieces) and pieces[j][0] < r[3]:
            if pieces[j][1] > r[2]:
                ri.append(i)
                pi.append(j)
            j += 1
    areas = np.zeros(len(bounds) - 1, dtype=np.int64)
    if not ri:
        return areas
    reg = np.asarray([c[:6] for c in clipped], dtype=np.int64)[ri]
    pc = np.asarray(pieces, dtype=np.int64)[pi]
    a = band_area_np(
        reg[:, 0],
        reg[:, 1],
        np.maximum(reg[:, 2], pc[:, 0]),
        np.minimum(reg[:, 3], pc[:, 1]),
        reg[:, 4],
        reg[:, 5],
    )
    np.add.at(areas, pc[:, 2], a)
    return areas


def cut_tokens(remote: list[tuple[int, int]], tb: list[int]) -> list[list[tuple[int, int]]]:
    """Split sorted global ranges into stages at the token offsets `tb`."""
    stages: list[list[tuple[int, int]]] = [[] for _ in range(len(tb) - 1)]
    for s, e, si in _pieces(remote, tb):
        stages[si].append((s, e))
    return stages


def _pieces(remote: list[tuple[int, int]], bounds: list[int]) -> list[tuple[int, int, int]]:
    """Sorted global ranges cut where their running token offset crosses ``bounds``: (start, end, index of
    the part ``[bounds[i], bounds[i + 1])`` of the offsets the piece falls in)."""
    pieces: list[tuple[int, int, int]] = []
    off, i = 0, 0
    for s, e in remote:
        while s < e:
            while bounds[i + 1] <= off:
                i += 1
            take = min(e - s, bounds[i + 1] - off)
            pieces.append((s, s + take, i))
            s += take
            off += take
    return pieces
