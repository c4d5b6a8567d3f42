"""The dispatch choice: which chunk size and assignment algorithm a mask is dispatched with.

With no explicit chunk size, every candidate size (the old default `min(2048, ceil(total / (8 cp)))` and
its halvings down to `_MIN_CHUNK`, never with more padding than the default) is judged without planning:

1. **Balance lower bound.** With chunk `c`, no assignment beats `max(mean rank area, the largest chunk plus
   the m - 1 smallest)` (`dispatch_lower_bound`), computed from the chunk areas (vectorised over the
   (slice, chunk) pairs). A size whose bound is more than `_BALANCE_SLACK` above the best candidate's is
   dropped: a few long documents hold most of the area and one chunk of them outweighs a rank's share.
2. **Assignment.** Each remaining size is assigned by `affinity` (a chunk goes to the rank that already
   holds the keys its rows need, or whose rows need its keys, while the rank stays within the bound; then
   swaps restore balance, and further swaps that never raise the maximum load bring a long document's
   chunks back to the rank fetching the most remote keys), which keeps a document's chunks on as few ranks
   as balance allows, or by `min_heap` when the chunk count is past `_AFFINITY_CHUNKS` (the affinity table
   is quadratic).
3. **Price.** The busiest rank's predicted forward + backward seconds with the H200 cost profile: its
   kernel time on `area + waste` (the tile-fill term: every (slice, chunk) piece leaves on average half a
   128-token tile unfilled along its query and its key edge, `64 * (q length + k length)` pairs; the H200
   kernel tables' tile-fill rows show the rate falling with the filled fraction), plus in the backward a
   fixed cost per key the rank holds or fetches (`_BWD_PAIRS_PER_KEY`, fitted to measured ranks), against the fetch of its
   remote K/V (exact: the union of the key ranges its rows need, less its own tokens; past 8 ranks the
   part from other nodes at 50 GB/s per GPU, the rest over NVLink); with overlap the slower of the two
   bounds the rank. The two largest sizes kept are priced (up to four while none keeps the busiest rank's
   remote K/V within `_REMOTE_BUDGET` of what the largest size with min_heap moves: smaller ones only add
   fragments and remote keys once the balance is reached). Among the candidates within `_BALANCE_SLACK` of
   the best achieved balance, those within the remote budget come first, and the cheapest wins (ties: the
   larger chunk); with none within the budget, the least remote K/V.

The choice is a pure function of the mask, cp size and the request (no communication), so every rank makes
the same one; `choose_dispatch` caches it (and the `DispatchPlan`) per mask digest, geometry and request,
so the runtime's layout and its plan share one solve.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .cost_model import OverlapCostModel, get_profile
from .dispatch import (
    DispatchAlg,
    DispatchPlan,
    _key_intervals,
    chunk_areas,
    dispatch_lower_bound,
    dispatch_slices,
    padded_seqlen,
)
from .pricing import rank_traffic, remote_kv_tokens

__all__ = [
    "DispatchChoice",
    "choose_dispatch",
    "clear_dispatch_cache",
    "default_chunk_size",
    "mask_digest",
    "remote_kv_tokens",
]

_MIN_CHUNKS_PER_RANK = 8
_DEFAULT_MAX_CHUNK = 2048
_MIN_CHUNK = 32
"""Smallest candidate chunk: below it the kernels' 128-row tiles are mostly fragments."""
_BALANCE_SLACK = 0.01
"""A candidate whose lower-bound imbalance (relative) or achieved imbalance (absolute) exceeds the best
candidate's by more than this is dropped."""
_AFFINITY_CHUNKS = 2048
"""Affinity's need table is chunks x chunks floats (16 MiB here); past it, min_heap."""
_PRICED = 2
"""Chunk sizes priced at least (the largest that balance); each costs one or two assignments."""
_PRICED_MAX = 4
"""Chunk sizes priced at most, while none keeps the remote K/V within the budget."""
_REMOTE_BUDGET = 1.1
"""Remote K/V of the busiest rank allowed over what the fixed rule (largest size, min_heap) moves (the
target is 1.25x; the margin lets a smaller size that keeps documents together win over a cheaper one)."""
_TOLERANCES = (0.0, 0.02, 0.05, 0.1)
"""Affinity's slack over the balance bound, tried in turn (`solve_dispatch`'s `affinity_tolerance`)."""
_TOLERANCE_CHUNKS = 512
"""Chunk counts up to which every tolerance is tried (each try is one more affinity assignment)."""
_NODE = 8
"""GPUs per node: past this many ranks, remote K/V from another node goes over the slower link."""
_INTERNODE_GBPS = 50.0
"""Per-GPU bandwidth between nodes (GB/s) the price assumes."""
_TILE = 128
_BWD_PAIRS_PER_KEY = 558
"""The backward's fixed work per key a rank holds or fetches, in (q, k) pairs of attention work: measured on
an H200 (2026-12-02, cuDNN, 64:8 heads, d 128, 8k tokens per GPU, 600 simulated ranks of five masks at cp
8-32, `benchmarks/results/2026-12-02_h200_scaling_8k.json`), a rank's backward time fits
`2.14 us x tiles + 9.33 us x key tiles` (R^2 0.999, median error 2.6 %): each 128-key column of the kernel
costs 4.36 tiles beyond its tiles (loading K / V, writing dK / dV), 4.36 x 128 x 128 / 128 pairs per key.
Only the choice's price carries it, to rank candidates of equal balance by the keys they read: the overlap
cost model's rates were fitted on full masks of 8k-query columns, which already hold the part of this cost
such columns pay, and adding the term there over-predicted the measured cp 2 backward of packed documents
by 20-40 % (`docs/benchmarks/cost_model.md`)."""
_CHOICE_CACHE_SIZE = 256
# the shape the choice prices with: the benchmarks' 64:8 heads, head dim 128, bf16 (only ratios of compute
# to communication matter for the choice, and those scale together with the heads)
_PRICE_MODEL = OverlapCostModel(get_profile("h200", "fa4"), 64, 8, 128)


@dataclass(frozen=True, slots=True)
class DispatchChoice:
    """How a mask is dispatched over `cp_size` ranks, and what it costs.

    Attributes:
        chunk_size: tokens per dispatch chunk.
        algorithm: the `DispatchAlg` value that assigned the chunks.
        overlap_degree: remote stages of the plan (0 = one merged stage); -1 before the plan is built.
        imbalance: max / mean of the ranks' mask area (1.0 is perfect).
        lower_bound_imbalance: no assignment with this chunk size does better.
        remote_kv_tokens_max: K/V tokens the busiest rank fetches from other ranks.
        reason: one sentence saying why this chunk size and algorithm.
    """

    chunk_size: int
    algorithm: str
    overlap_degree: int
    imbalance: float
    lower_bound_imbalance: float
    remote_kv_tokens_max: int
    reason: str

    def with_plan(self, overlap_degree: int, remote_kv_tokens_max: int) -> DispatchChoice:
        """This choice with the built plan's overlap degree and measured remote K/V."""
        return DispatchChoice(
            self.chunk_size,
            self.algorithm,
            int(overlap_degree),
            self.imbalance,
            self.lower_bound_imbalance,
            int(remote_kv_tokens_max),
            self.reason,
        )


def default_chunk_size(total_seqlen: int, cp_size: int) -> int:
    """The largest chunk the choice considers: min(2048, ceil(total / (8 cp))), about eight chunks per rank
    (the fixed rule of earlier releases)."""
    return max(1, min(_DEFAULT_MAX_CHUNK, math.ceil(total_seqlen / (_MIN_CHUNKS_PER_RANK * cp_size))))


def mask_digest(slices: list[tuple[int, int, int, int, int]]) -> str:
    """A digest of validated `(qs, qe, ks, ke, code)` slices (cache keys; equal masks, equal digests)."""
    arr = np.asarray(slices, dtype=np.int64).reshape(-1, 5)
    return hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()


def group_by_node(plan: DispatchPlan, traffic: np.ndarray, node_size: int = _NODE) -> DispatchPlan:
    """The same assignment with its ranks renumbered so that ranks exchanging the most keys share a node
    (ranks `node_size * k` to `node_size * (k + 1) - 1`): every rank keeps its chunks, its area and its
    remote K/V; fewer of those keys cross nodes. `traffic`: `rank_traffic` of `plan`. A deterministic
    function of its inputs (the same numbering on every rank); unchanged at cp <= node_size."""
    cp = plan.cp_size
    if cp <= node_size:
        return plan
    w = (traffic + traffic.T).astype(np.float64)
    free = np.ones(cp, dtype=bool)
    nodes: list[list[int]] = []
    while free.any():
        ids = np.flatnonzero(free)
        seed = int(ids[np.argmax(w[np.ix_(ids, ids)].sum(axis=1))])  # the rank most tied to the others
        node = [seed]
        free[seed] = False
        while len(node) < node_size and free.any():
            ids = np.flatnonzero(free)
            pick = int(ids[np.argmax(w[np.ix_(ids, node)].sum(axis=1))])  # ties: the lowest rank
            node.append(pick)
            free[pick] = False
        nodes.append(node)
    # pairwise swaps between nodes while one keeps more traffic inside nodes (a few passes suffice)
    where = np.empty(cp, dtype=np.int64)
    for k, node in enumerate(nodes):
        where[node] = k
    for _ in range(8):
        inside = np.stack([w[:, node].sum(axis=1) for node in nodes], axis=1)  # [cp, nodes]
        ka, kb = where[:, None], where[None, :]
        gain = (inside[np.arange(cp)[:, None], kb] - inside[np.arange(cp)[:, None], ka]
                + inside[np.arange(cp)[None, :], ka] - inside[np.arange(cp)[None, :], kb] - 2 * w)  # fmt: skip
        gain[ka == kb] = 0.0
        a, b = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[a, b] <= 0.5:  # traffic counts tokens: at least one more inside, or stop
            break
        na, nb = nodes[where[a]], nodes[where[b]]
        na[na.index(a)], nb[nb.index(b)] = int(b), int(a)
        where[a], where[b] = where[b], where[a]
    order = [r for node in nodes for r in sorted(node)]

    def crossing(numbering: list[int]) -> tuple[int, int]:
        """(busiest rank's, all ranks') keys from other nodes with rank `numbering[i]` at position i."""
        node_of = np.empty(cp, dtype=np.int64)
        node_of[numbering] = np.arange(cp) // node_size
        out = np.where(node_of[:, None] != node_of[None, :], traffic, 0).sum(axis=1)
        return int(out.max()), int(out.sum())

    # the grouping maximises the keys kept inside nodes; the price pays for the busiest rank's crossing
    # keys, so the old numbering stays where it crosses less there
    if order == list(range(cp)) or crossing(order) >= crossing(list(range(cp))):
        return plan
    return dataclasses.replace(
        plan,
        partitions=tuple(plan.partitions[r] for r in order),
        rank_areas=tuple(plan.rank_areas[r] for r in order),
    )


@dataclass(frozen=True, slots=True)
class _Candidate:
    chunk_size: int
    plan: DispatchPlan
    remote: np.ndarray
    seconds: float


def _price(
    plan: DispatchPlan, waste_per_chunk: np.ndarray, remote: np.ndarray, inter: np.ndarray | None
) -> float:
    """The busiest rank's predicted forward + backward seconds (see the module docstring); `inter`: the
    part of each rank's remote K/V from outside its node (None: one node), fetched at `_INTERNODE_GBPS`
    while the rest comes over NVLink (the slower link sets the time)."""
    m = _PRICE_MODEL
    worst = 0.0
    # bytes per token there and back: K and V forward, dK and dV in the backward's reduce. The price is
    # taken before the overlap degree is known and prices the merged schedule's traffic (degree 0), whose
    # reduce sends the kernel's dK / dV in the input dtype (the owner sums them in fp32)
    wire = m.kv_bytes_per_token + m.merged_grad_kv_bytes_per_token
    for r, part in enumerate(plan.partitions):
        area = plan.rank_areas[r] + float(waste_per_chunk[list(part)].sum())
        # every key the rank holds or fetches is a column of its backward kernel: remote keys cost compute too
        keys = plan.shard_seqlens[r] + int(remote[r])
        comp = m.calc(area) + m.calc(area + _BWD_PAIRS_PER_KEY * keys, backward=True)
        comm = m.fetch(remote[r]) + m.reduce(remote[r], merged=True) if remote[r] else 0.0
        if inter is not None and inter[r]:
            comm = max(comm, float(inter[r]) * wire / (_INTERNODE_GBPS * 1e9))
        worst = max(worst, comp, comm)
    return worst


def _assign(
    slices: list, total: int, cp: int, chunk: int, alg: DispatchAlg, uneven: bool, tolerance: float = 0.0
) -> DispatchPlan:
    return dispatch_slices(slices, total, cp, chunk, alg, affinity_tolerance=tolerance, uneven_shard=uneven)


_CACHE: OrderedDict[tuple, tuple[DispatchChoice, DispatchPlan]] = OrderedDict()


def clear_dispatch_cache() -> None:
    """Forget every cached choice (benchmarks time the solve itself; tests start clean)."""
    _CACHE.clear()


def choose_dispatch(
    slices: list[tuple[int, int, int, int, int]],
    total_seqlen: int,
    cp_size: int,
    *,
    chunk_size: int | None = None,
    alg: DispatchAlg | str | None = None,
    uneven_shard: bool = False,
    cross_attention: bool = False,
    digest: str | None = None,
) -> tuple[DispatchChoice, DispatchPlan]:
    """Choose (or take) the chunk size and algorithm for a validated mask and solve its dispatch (cached).

    Args:
        slices: validated `(qs, qe, ks, ke, code)` slices over the *unpadded* sequence.
        total_seqlen: tokens of the query sequence before padding.
        cp_size: ranks.
        chunk_size: an explicit chunk size (always respected), or None to choose one.
        alg: an explicit algorithm, or None: `affinity` (or `min_heap` past `_AFFINITY_CHUNKS` chunks, and
            for cross-attention) with a chosen chunk size, `min_heap` with an explicit one.
        uneven_shard: no padding (see `solve_dispatch`); otherwise the sequence is padded to a multiple
            of `chunk_size * cp_size` and the returned plan's `total_seqlen` is the padded length.
        cross_attention: keys are another sequence (no affinity; remote K/V then depends on the key layout
            and is reported as 0 here: the plan measures it).
        digest: `mask_digest(slices)` if the caller has it.

    Returns:
        `(choice, dispatch)`; `choice.overlap_degree` is -1 (the plan sets it). Raises ValueError on bad
        geometry (naming the argument).
    """
    digest = digest or mask_digest(slices)
    alg_req = None if alg is None else DispatchAlg(alg)
    key = (digest, int(total_seqlen), int(cp_size), chunk_size, alg_req, bool(uneven_shard), cross_attention)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    result = _choose(
        slices, int(total_seqlen), int(cp_size), chunk_size, alg_req, uneven_shard, cross_attention
    )
    _CACHE[key] = result
    while len(_CACHE) > _CHOICE_CACHE_SIZE:
        _CACHE.popitem(last=False)
    return result


def _choose(
    slices: list,
    total: int,
    cp: int,
    chunk_size: int | None,
    alg: DispatchAlg | None,
    uneven: bool,
    cross: bool,
) -> tuple[DispatchChoice, DispatchPlan]:
    def geometry(c: int) -> int:
        return total if uneven else padded_seqlen(total, cp, c)

    def finish(plan: DispatchPlan, remote: np.ndarray, reason: str) -> tuple[DispatchChoice, DispatchPlan]:
        choice = DispatchChoice(
            plan.chunk_size,
            plan.alg.value,
            -1,
            plan.imbalance,
            plan.lower_bound_imbalance,
            int(remote.max()) if remote.size else 0,
            reason,
        )
        return choice, plan

    def remote_of(plan: DispatchPlan, group: int = 1) -> np.ndarray:
        if cross:
            return np.zeros(cp, dtype=np.int64)
        chunk, _, kl, kr = _key_intervals(slices, plan.chunk_size)
        return remote_kv_tokens(np.asarray(plan.chunk_owner), chunk, kl, kr, plan.chunk_size, cp, group)

    if chunk_size is not None:
        a = alg or DispatchAlg.MIN_HEAP
        plan = _assign(slices, geometry(chunk_size), cp, chunk_size, a, uneven)
        return finish(plan, remote_of(plan), f"chunk size {chunk_size} and algorithm {a.value} were given.")

    c0 = default_chunk_size(total, cp)
    sizes = [c0]
    while sizes[-1] % 2 == 0 and sizes[-1] // 2 >= _MIN_CHUNK:
        sizes.append(sizes[-1] // 2)
    base_len = geometry(c0)
    # equal chunk counts need cp whole chunks; never pad more than the default size does
    sizes = [c for c in sizes if geometry(c) <= base_len and -(-geometry(c) // c) >= cp]
    if not sizes:
        sizes = [c0]
    bounds = {}
    for c in sizes:
        areas = chunk_areas(slices, geometry(c), c)
        total_area = int(areas.sum())
        lb = dispatch_lower_bound(areas, cp)
        bounds[c] = lb * cp / total_area if total_area else 1.0
    best_lb = min(bounds.values())
    keep = [c for c in sizes if bounds[c] <= best_lb * (1.0 + _BALANCE_SLACK)]
    dropped = [c for c in sizes if c not in keep]
    # the remote K/V budget: what the fixed rule (the largest size, min_heap) moves, times _REMOTE_BUDGET
    fixed = _assign(slices, geometry(c0), cp, c0, DispatchAlg.MIN_HEAP, uneven)
    budget = _REMOTE_BUDGET * max(int(remote_of(fixed).max()), 1)
    # smaller chunks only add fragments and remote keys once the balance is reached: price the largest sizes
    # that balance, two at least, more while none keeps within the budget
    cands: list[_Candidate] = []
    priced = []
    for c in keep[:_PRICED_MAX]:
        more = len(priced) >= _PRICED
        if more and (any(x.remote.max(initial=0) <= budget for x in cands) or -(-geometry(c) // c) > 1024):
            break  # past the first sizes, only small chunk tables are worth another try
        priced.append(c)
        n = -(-geometry(c) // c)
        a = alg or (DispatchAlg.AFFINITY if not cross and n <= _AFFINITY_CHUNKS else DispatchAlg.MIN_HEAP)
        chunk, qlen, kl, kr = _key_intervals(slices, c)
        waste = np.zeros(n, dtype=np.float64)
        np.add.at(waste, chunk, (_TILE // 2) * (qlen + (kr - kl)).astype(np.float64))
        # affinity may also let a rank run a little over the bound while it collects a document's chunks
        # (the swaps then restore the balance): tried where the chunk table is small
        tolerances = _TOLERANCES if a is DispatchAlg.AFFINITY and n <= _TOLERANCE_CHUNKS else (0.0,)
        for tol in tolerances:
            plan = _assign(slices, geometry(c), cp, c, a, uneven, tol)
            if not cross and cp > _NODE:  # past one node: ranks that exchange most keys share one
                plan = group_by_node(plan, rank_traffic(np.asarray(plan.chunk_owner), chunk, kl, kr, c, cp))
            remote = remote_of(plan)
            inter = None if cross or cp <= _NODE else remote_of(plan, _NODE)
            cands.append(_Candidate(c, plan, remote, _price(plan, waste, remote, inter)))
    # the price weighs balance against fragments and communication; the balance itself stays near the best,
    # and the remote K/V within the budget where a candidate can
    balanced = min(x.plan.imbalance for x in cands) + _BALANCE_SLACK
    ok = [x for x in cands if x.plan.imbalance <= balanced]
    within = [x for x in ok if x.remote.max(initial=0) <= budget]
    if within:
        best = min(within, key=lambda x: (round(x.seconds, 9), -x.chunk_size))
    else:
        best = min(ok, key=lambda x: (int(x.remote.max(initial=0)), round(x.seconds, 9), -x.chunk_size))
    keep = priced
    why = (
        f"chunk {best.chunk_size} ({best.plan.alg.value}) has the lowest predicted time of the busiest rank "
        f"({best.seconds * 1e3:.3g} ms fwd+bwd on the H200 profile) among {', '.join(map(str, keep))}"
    )
    if dropped:
        why += f"; {', '.join(map(str, dropped))} cannot balance below {min(bounds[c] for c in dropped):.3f}"
    return finish(best.plan, best.remote, why + ".")
