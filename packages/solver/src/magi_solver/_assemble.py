"""The assembly of a plan from a solved dispatch: the overlap degree priced per candidate, each rank's
remote K/V cut into stages, the GroupCast arguments of every stage, and each rank's slices cut by where
their keys live (`plan_attention` is the entry; this module is its second half).

Invariant (tested densely): every (q, k) pair of the mask is computed exactly once, by the rank owning q,
either in `host_slices` or in exactly one stage's `remote_slices` (and exactly once in `merged_slices`);
each stage fetches only keys the rank's rows need and does not hold (zero redundancy).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._plan_types import DistAttnPlan, PlanOptions, RankPlan, StagePlan
from ._slicing import clip_rows, host_area_of, merge_full, slice_over
from .choice import DispatchChoice
from .comm import GroupCastArgs, build_cast_args
from .dispatch import DispatchPlan
from .kv_layout import KVLayout
from .mask import SliceList, total_area
from .overlap import FactorCostModel, OverlapMode, cut_tokens, stage_layouts
from .ranges import AttnRange, AttnRanges, merge_pairs, subtract_pairs


@dataclass(frozen=True, slots=True, eq=False)
class Dispatched:
    """A mask after the dispatch step: what the assembly needs besides the options.

    Attributes:
        dispatch: the chunk assignment of the queries.
        slices: the mask's checked `(qs, qe, ks, ke, code)` slices (keys in `kv_layout`'s sequence in
            cross-attention).
        choice: how the chunk size and algorithm were chosen; the plan's copy also carries its overlap
            degree and measured remote K/V.
        kv_layout: cross-attention: where keys and values live; None: with the queries (self-attention).
    """

    dispatch: DispatchPlan
    slices: list[tuple[int, int, int, int, int]]
    choice: DispatchChoice
    kv_layout: KVLayout | None = None


def build_plan(step: Dispatched, options: PlanOptions) -> DistAttnPlan:
    """The plan of every rank for a dispatched mask, its overlap degree chosen (dynamic mode) or taken
    (static) under `options` (cost: `options.cost_model`, else the factor-only estimate)."""
    dispatch, slices, kv_layout = step.dispatch, step.slices, step.kv_layout
    cost = options.cost_model or FactorCostModel(options.calc_cost_factor, options.comm_cost_factor)
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
    if options.overlap_mode is OverlapMode.DYNAMIC:
        candidates = list(range(options.dynamic_max_degree + 1))
    else:
        candidates = [options.overlap_degree or 0]
    layouts = [
        stage_layouts(remote[r], clipped[r], options.min_chunk_size, options.max_num_chunks, candidates)
        for r in range(cp)
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
    ranks = tuple(
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
    )
    return DistAttnPlan(
        dispatch=dispatch,
        ranks=ranks,
        num_stages=num_stages,
        overlap_degree=chosen,
        predicted_times=tuple(times[chosen]),
        degree_costs=degree_costs,
        kv_layout=kv_layout,
        choice=step.choice.with_plan(chosen, max(r.num_remote_tokens for r in ranks)),
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
