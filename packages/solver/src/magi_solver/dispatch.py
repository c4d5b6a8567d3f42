"""Dispatch solver: cut the sequence into chunks and give every rank the same number of chunks (within one
with uneven shards), balancing the attention work (the mask area of each chunk's rows).

Self-attention: q and k share one sequence and one dispatch. The plan type and the size rules live in
`magi_solver.dispatch_plan`, the per-chunk areas and key needs in `magi_solver.chunk_geometry`, the
assignment algorithms in `magi_solver.chunk_assignment`; this module is the entry (`solve_dispatch`) and
hands on their public names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .chunk_assignment import _affinity, _min_heap, _sequential, _zigzag, dispatch_lower_bound
from .chunk_geometry import _key_intervals as _key_intervals  # the planner's pricing and placements use it
from .chunk_geometry import chunk_areas
from .dispatch_plan import DispatchAlg, DispatchPlan, validate_geometry
from .dispatch_plan import padded_seqlen as padded_seqlen  # where the planner has always imported it
from .mask import normalize_mask
from .ranges import _check_int

__all__ = [
    "DispatchAlg",
    "DispatchPlan",
    "chunk_areas",
    "dispatch_lower_bound",
    "redispatch_areas",
    "solve_dispatch",
    "validate_geometry",
]


PLACEMENTS: dict[DispatchAlg, Callable[[list, int, int, int, bool], DispatchPlan]] = {}
"""Algorithms of their own modules built on this one (`documents` registers DOCUMENTS when imported, as
`import magi_solver` does): `(slices, total_seqlen, cp_size, chunk_size, uneven_shard) -> DispatchPlan`."""


def solve_dispatch(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    chunk_size: int,
    alg: str | DispatchAlg = "min_heap",
    *,
    affinity_tolerance: float = 0.0,
    total_seqlen_k: int | None = None,
    uneven_shard: bool = False,
) -> DispatchPlan:
    """Assign the `total_seqlen // chunk_size` chunks to `cp_size` ranks, `num_chunks // cp_size` each
    (uneven shards: `ceil(total_seqlen / chunk_size)` chunks, counts within one of each other).

    Args:
        q_ranges, k_ranges: per slice `[start, end)` (a list of pairs, an `[n, 2]` array or `AttnRanges`);
            slices may overlap in q, in k and even in (q, k) pairs: the mask is their union.
        attn_mask_type: one type for all slices or one per slice: `AttnMaskType`, its name, or int code 0-3.
        total_seqlen: tokens of the sequence (q and k: self-attention); a multiple of `chunk_size`
            (any length with `uneven_shard`).
        cp_size: number of ranks; must divide the chunk count (at most the chunk count with `uneven_shard`).
        chunk_size: tokens per chunk.
        alg: a `DispatchAlg` value ("min_heap", "sequential", "zigzag", "affinity", "documents").
        affinity_tolerance: for "affinity", how far above the balance lower bound (as a fraction) a rank's
            load may grow when it is chosen for affinity rather than for being least loaded.
        total_seqlen_k: cross-attention: length of the key sequence `k_ranges` index (None: self-attention,
            keys are the query sequence); only the queries are dispatched here.
        uneven_shard: no padding: the last chunk may be short and the ranks' chunk counts may differ by one
            (every algorithm; zigzag then cuts `2 * cp_size` blocks of sizes within one of each other).

    Returns:
        A `DispatchPlan`. Raises `ValueError` (naming the argument or slice) on bad input.
    """
    total_seqlen, cp_size, chunk_size = validate_geometry(
        total_seqlen, cp_size, chunk_size, uneven_shard=uneven_shard
    )
    if total_seqlen_k is not None and DispatchAlg(alg) in (DispatchAlg.AFFINITY, DispatchAlg.DOCUMENTS):
        raise ValueError(
            f"alg={DispatchAlg(alg).value!r} pairs query and key chunks of one sequence: not for cross-attention"
        )
    total_k = total_seqlen if total_seqlen_k is None else _check_int(total_seqlen_k, "total_seqlen_k")
    slices = normalize_mask(q_ranges, k_ranges, attn_mask_type, total_seqlen, total_k)
    return dispatch_slices(
        slices,
        total_seqlen,
        cp_size,
        chunk_size,
        alg,
        affinity_tolerance=affinity_tolerance,
        uneven_shard=uneven_shard,
    )


def dispatch_slices(
    slices: list[tuple[int, int, int, int, int]],
    total_seqlen: int,
    cp_size: int,
    chunk_size: int,
    alg: str | DispatchAlg = "min_heap",
    *,
    affinity_tolerance: float = 0.0,
    uneven_shard: bool = False,
) -> DispatchPlan:
    """`solve_dispatch` on already validated `(qs, qe, ks, ke, code)` slices."""
    try:
        alg = DispatchAlg(alg)
    except ValueError:
        raise ValueError(f"`alg` must be one of {[a.value for a in DispatchAlg]}, got {alg!r}") from None
    if not affinity_tolerance >= 0.0:
        raise ValueError(f"`affinity_tolerance` must be >= 0, got {affinity_tolerance}")
    if alg in PLACEMENTS:  # placements of their own modules built on this one (documents)
        return PLACEMENTS[alg](slices, total_seqlen, cp_size, chunk_size, uneven_shard)
    areas = chunk_areas(slices, total_seqlen, chunk_size).tolist()
    num_chunks = len(areas)
    if alg is DispatchAlg.MIN_HEAP:
        parts = _min_heap(areas, cp_size)
    elif alg is DispatchAlg.SEQUENTIAL:
        parts = _sequential(num_chunks, cp_size)
    elif alg is DispatchAlg.ZIGZAG:
        parts = _zigzag(num_chunks, cp_size, uneven_shard)
    else:
        parts = _affinity(areas, cp_size, slices, chunk_size, affinity_tolerance)
    partitions = tuple(tuple(sorted(p)) for p in parts)
    return DispatchPlan(
        total_seqlen=total_seqlen,
        cp_size=cp_size,
        chunk_size=chunk_size,
        num_chunks=num_chunks,
        partitions=partitions,
        chunk_areas=tuple(areas),
        rank_areas=tuple(sum(areas[c] for c in p) for p in partitions),
        alg=alg,
        lower_bound=dispatch_lower_bound(areas, cp_size),
        uneven_shard=uneven_shard,
    )


def redispatch_areas(plan: DispatchPlan, slices: list[tuple[int, int, int, int, int]]) -> DispatchPlan:
    """`plan`'s chunk assignment with the chunk and rank areas of another (validated) mask.

    For a mask built after dispatch (e.g. a different mask on the same dispatched tokens): the tokens stay
    where they are, only the costs change.
    """
    areas = chunk_areas(slices, plan.total_seqlen, plan.chunk_size).tolist()
    return dataclasses.replace(
        plan,
        chunk_areas=tuple(areas),
        rank_areas=tuple(sum(areas[c] for c in p) for p in plan.partitions),
        lower_bound=dispatch_lower_bound(areas, plan.cp_size),
    )
