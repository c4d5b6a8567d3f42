"""The dispatch choice: which placement, chunk size and assignment algorithm a mask is dispatched with.

Every candidate is priced by one law (`kernel_law`, the law of the backend `auto` picks for the whole mask;
`pricing.price_plan`): each rank's forward and backward kernel time from its mask area, its key columns
(own tokens plus received keys) and its rows, plus the link time of its received K/V (NVLink inside a
node, 50 GB/s per GPU across nodes); the step is the slowest forward plus the slowest backward.

With no algorithm and no chunk size (the default) two placements are compared by that predicted step and
the faster taken: the documents placement (`documents`, whole units on as few ranks as balance of
predicted time allows) and the chunk dispatch below. Self-attention only for the documents placement: on
cross-attention the chunk dispatch is taken and the reason says so. An explicit algorithm is used as given
(`documents` on cross-attention raises ValueError); an explicit chunk size without an algorithm keeps the
chunk dispatch with `min_heap`.

The chunk dispatch with a chosen chunk size: every candidate size (the old default `min(2048, ceil(total /
(8 cp)))` and its halvings down to `_MIN_CHUNK`, never with more padding than the default) is judged:

1. **Balance lower bound.** With chunk `c`, no assignment beats `max(mean rank area, the largest chunk plus
   the m - 1 smallest)` (`dispatch_lower_bound`). A size whose bound is more than `_BALANCE_SLACK` above
   the best candidate's is dropped.
2. **Assignment.** Each remaining size is assigned by the algorithm asked for (`affinity`: a chunk goes to
   the rank that already holds the keys its rows need while the rank stays within the bound, swaps then
   restore balance and lower the busiest fetcher's remote keys; it also tries its tolerances `_TOLERANCES`
   on small chunk tables), or, in the default's comparison, by `min_heap` (cheap: the documents placement
   is the one that keeps documents together).
3. **Price.** The law's predicted step. The two largest sizes kept are priced (up to four while none keeps
   the busiest rank's remote K/V within `_REMOTE_BUDGET` of what the largest size with min_heap moves).
   Among the candidates within `_BALANCE_SLACK` of the best achieved balance, those within the remote
   budget come first, and the cheapest wins (ties: the larger chunk); with none within the budget, the
   least remote K/V.

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

from .dispatch import (
    DispatchAlg,
    DispatchPlan,
    _key_intervals,
    chunk_areas,
    dispatch_lower_bound,
    dispatch_slices,
    padded_seqlen,
)
from .documents import documents_granularity, documents_plans
from .kernel_law import KernelLaw, law_for_mask
from .node_groups import node_order
from .pricing import PlanPrice, price_plan, rank_traffic, remote_kv_tokens

__all__ = [
    "DispatchChoice",
    "choose_dispatch",
    "chosen_times",
    "clear_dispatch_cache",
    "default_chunk_size",
    "mask_digest",
    "predicted_choice_times",
    "prepare_choice",
    "remember_choice",
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
_PRUNE = 0.05
"""The default prices the chunk dispatch's smaller chunk sizes only when the documents placement is not this
share faster than its fixed rule (on the mask families the best size gains at most 2.4 % over that rule)."""
_NODE = 8
"""GPUs per node: past this many ranks, ranks exchanging the most keys are grouped into one."""
_CHOICE_CACHE_SIZE = 256


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
        predicted_fwd_ms, predicted_bwd_ms: the slowest rank's forward / backward kernel time by the kernel
            law (`kernel_law`, the law of the backend `auto` would pick for the whole mask, at 64:8 heads,
            head dim 128, bf16; communication not included); None where not computed.
    """

    chunk_size: int
    algorithm: str
    overlap_degree: int
    imbalance: float
    lower_bound_imbalance: float
    remote_kv_tokens_max: int
    reason: str
    predicted_fwd_ms: float | None = None
    predicted_bwd_ms: float | None = None

    def with_plan(self, overlap_degree: int, remote_kv_tokens_max: int) -> DispatchChoice:
        """This choice with the built plan's overlap degree and measured remote K/V."""
        return dataclasses.replace(
            self, overlap_degree=int(overlap_degree), remote_kv_tokens_max=int(remote_kv_tokens_max)
        )


def predicted_choice_times(price: PlanPrice) -> tuple[float, float]:
    """`(predicted_fwd_ms, predicted_bwd_ms)` of a `PlanPrice`: its slowest rank's kernel times."""
    return float(price.fwd_ms.max()), float(price.bwd_ms.max())


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
    order = node_order(traffic, plan.cp_size, node_size)
    if order is None:
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
    price: PlanPrice

    @property
    def seconds(self) -> float:
        return self.price.step_ms * 1e-3


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
        alg: an explicit algorithm, or None: the documents placement or the chunk dispatch, whichever the
            law predicts faster (the chunk dispatch for cross-attention), with a chosen chunk size;
            `min_heap` with an explicit one.
        uneven_shard: no padding (see `solve_dispatch`); otherwise the sequence is padded to a multiple
            of `chunk_size * cp_size` and the returned plan's `total_seqlen` is the padded length.
        cross_attention: keys are another sequence (no affinity; remote K/V then depends on the key layout
            and is reported as 0 here: the plan measures it).
        digest: `mask_digest(slices)` if the caller has it.

    Returns:
        `(choice, dispatch)`; `choice.overlap_degree` is -1 (the plan sets it). Raises ValueError on bad
        geometry (naming the argument).
    """
    _, choice, plan = prepare_choice(
        slices,
        total_seqlen,
        cp_size,
        chunk_size=chunk_size,
        alg=alg,
        uneven_shard=uneven_shard,
        cross_attention=cross_attention,
        digest=digest,
    )
    return choice, plan


def prepare_choice(
    slices: list[tuple[int, int, int, int, int]],
    total_seqlen: int,
    cp_size: int,
    *,
    chunk_size: int | None = None,
    alg: DispatchAlg | str | None = None,
    uneven_shard: bool = False,
    cross_attention: bool = False,
    digest: str | None = None,
) -> tuple[tuple, DispatchChoice, DispatchPlan]:
    """`(request, choice, plan)`: `choose_dispatch`'s answer with the request it answered (the cache's key:
    mask digest, total, cp size, chunk size, algorithm asked, uneven shards, cross-attention), taken from
    the cache (solved or remembered before) or solved and cached. Arguments as `choose_dispatch`."""
    digest = digest or mask_digest(slices)
    alg_req = None if alg is None else DispatchAlg(alg)
    key = (digest, int(total_seqlen), int(cp_size), chunk_size, alg_req, bool(uneven_shard), cross_attention)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
    else:
        hit = _choose(
            slices, int(total_seqlen), int(cp_size), chunk_size, alg_req, uneven_shard, cross_attention
        )
        remember_choice(key, hit)
    return (key, *hit)


def remember_choice(request: tuple, result: tuple[DispatchChoice, DispatchPlan]) -> None:
    """Cache `(choice, plan)` as the answer to `request` (a `prepare_choice` request); an answer cached already
    stays (plans built on it find it by identity, `chosen_times`)."""
    _CACHE.setdefault(request, result)
    _CACHE.move_to_end(request)
    while len(_CACHE) > _CHOICE_CACHE_SIZE:
        _CACHE.popitem(last=False)


def chosen_times(
    plan: DispatchPlan, digest: str, total_q: int, cross: bool
) -> tuple[float | None, float | None] | None:
    """`(predicted_fwd_ms, predicted_bwd_ms)` that `choose_dispatch` computed for `plan`, if it chose this very
    plan object (still cached) for the mask of `digest` (`mask_digest`) over `total_q` query tokens, self- or
    cross-attention as `cross`: exactly what `price_plan(plan, slices, law_for_mask(slices, total_q),
    cross=cross)` gives again (a plan built on the chosen dispatch reuses it). None otherwise."""
    for key, (choice, cached) in reversed(_CACHE.items()):  # the newest first: a key's layout just solved it
        if cached is plan and key[0] == digest and key[1] == total_q and key[6] == cross:
            return choice.predicted_fwd_ms, choice.predicted_bwd_ms
    return None


def _choose(
    slices: list,
    total: int,
    cp: int,
    chunk_size: int | None,
    alg: DispatchAlg | None,
    uneven: bool,
    cross: bool,
) -> tuple[DispatchChoice, DispatchPlan]:
    if alg is DispatchAlg.DOCUMENTS and cross:
        raise ValueError("alg='documents' keeps units of one sequence together: not for cross-attention")
    law = law_for_mask(slices, total)
    if alg is DispatchAlg.DOCUMENTS:
        best = _documents_candidate(slices, total, cp, chunk_size, uneven, law)
        how = "given" if chunk_size is not None else "chosen by the placement"
        why = f"the documents placement was asked for (chunk {best.chunk_size}, {how})."
        return _finish(best, why)
    if chunk_size is not None:
        a = alg or DispatchAlg.MIN_HEAP
        geo = total if uneven else padded_seqlen(total, cp, chunk_size)
        plan = _assign(slices, geo, cp, chunk_size, a, uneven)
        cand = _priced(slices, plan, cp, law, cross)
        return _finish(cand, f"chunk size {chunk_size} and algorithm {a.value} were given.")
    if alg is None and not cross:
        # the default: the documents placement against the chunk dispatch, by the predicted step; the chunk
        # dispatch's other sizes gain little over its fixed rule, so they are priced only when the
        # placement does not beat that rule by `_PRUNE` (a new mask every step pays for its key)
        docs = _documents_candidate(slices, total, cp, None, uneven, law)
        c0 = default_chunk_size(total, cp)
        geo = total if uneven else padded_seqlen(total, cp, c0)
        fixed = _priced(slices, _assign(slices, geo, cp, c0, DispatchAlg.MIN_HEAP, uneven), cp, law, cross)
        if docs.seconds <= fixed.seconds * (1.0 - _PRUNE):
            return _finish(
                docs,
                f"the documents placement is faster: predicted step {docs.seconds * 1e3:.3g} ms (documents, "
                f"chunk {docs.chunk_size}) against {fixed.seconds * 1e3:.3g} ms (chunk dispatch, chunk {c0} "
                f"min_heap; smaller chunks, which gain at most a few percent over it, were not priced).",
            )
    else:
        fixed = None
    chunked, why = _choose_chunked(slices, total, cp, alg, uneven, cross, law, fixed)
    if alg is not None:
        return _finish(chunked, why)
    if cross:
        return _finish(chunked, why[:-1] + "; the documents placement needs self-attention.")
    lead = (
        f"predicted step {docs.seconds * 1e3:.3g} ms (documents, chunk {docs.chunk_size}) against "
        f"{chunked.seconds * 1e3:.3g} ms (chunk dispatch, chunk {chunked.chunk_size} {chunked.plan.alg.value})"
    )
    if docs.seconds < chunked.seconds:
        return _finish(docs, f"the documents placement is faster: {lead}.")
    return _finish(chunked, f"the chunk dispatch is not slower: {lead}; {why}")


def _finish(best: _Candidate, reason: str) -> tuple[DispatchChoice, DispatchPlan]:
    plan = best.plan
    fwd, bwd = predicted_choice_times(best.price)
    choice = DispatchChoice(
        plan.chunk_size,
        plan.alg.value,
        -1,
        plan.imbalance,
        plan.lower_bound_imbalance,
        int(best.remote.max()) if best.remote.size else 0,
        reason,
        fwd,
        bwd,
    )
    return choice, plan


def _priced(slices: list, plan: DispatchPlan, cp: int, law: KernelLaw, cross: bool) -> _Candidate:
    """`plan` (ranks renumbered by node past one node) with its law price."""
    pieces = _key_intervals(slices, plan.chunk_size)
    if not cross and cp > _NODE:  # past one node: ranks that exchange most keys share one
        chunk, _, kl, kr = pieces
        owner = np.asarray(plan.chunk_owner)
        plan = group_by_node(plan, rank_traffic(owner, chunk, kl, kr, plan.chunk_size, cp))
    price = price_plan(plan, slices, law, cross=cross, pieces=pieces)
    return _Candidate(plan.chunk_size, plan, price.remote, price)


def _documents_candidate(
    slices: list, total: int, cp: int, chunk_size: int | None, uneven: bool, law: KernelLaw
) -> _Candidate:
    c = chunk_size or documents_granularity(total, cp)
    if chunk_size is None and not uneven:  # never pad more than the chunk dispatch's default size does
        most = padded_seqlen(total, cp, default_chunk_size(total, cp))
        while c > 1 and padded_seqlen(total, cp, c) > most:
            c //= 2
    # the placement ranks its assignments itself, past one node on the numbering by node (`_priced` then
    # keeps that numbering unless another crosses less)
    (plan,) = documents_plans(slices, total, cp, law, uneven_shard=uneven, chunk_size=c)
    return _priced(slices, plan, cp, law, False)


def _choose_chunked(
    slices: list,
    total: int,
    cp: int,
    alg: DispatchAlg | None,
    uneven: bool,
    cross: bool,
    law: KernelLaw,
    fixed: _Candidate | None = None,
) -> tuple[_Candidate, str]:
    """The chunk dispatch with a chosen chunk size (see the module docstring): the best candidate and why.
    With `alg` None (the default's comparison against the documents placement) every size is assigned by
    `min_heap`, which keeps a new mask's key cheap. `fixed`: the fixed rule's candidate (the largest size,
    `min_heap`) when the caller priced it already (each assignment and price is made once per key)."""

    def geometry(c: int) -> int:
        return total if uneven else padded_seqlen(total, cp, c)

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
    for c, areas in zip(sizes, _size_areas(slices, sizes, geometry), strict=True):
        total_area = int(areas.sum())
        lb = dispatch_lower_bound(areas, cp)
        bounds[c] = lb * cp / total_area if total_area else 1.0
    best_lb = min(bounds.values())
    keep = [c for c in sizes if bounds[c] <= best_lb * (1.0 + _BALANCE_SLACK)]
    dropped = [c for c in sizes if c not in keep]
    # the remote K/V budget: what the fixed rule (the largest size, min_heap) moves, times _REMOTE_BUDGET
    if fixed is None:
        fixed = _priced(
            slices, _assign(slices, geometry(c0), cp, c0, DispatchAlg.MIN_HEAP, uneven), cp, law, cross
        )
    budget = _REMOTE_BUDGET * max(int(fixed.remote.max(initial=0)), 1)
    # smaller chunks only add fragments and remote keys once the balance is reached: price the largest sizes
    # that balance, two at least, more while none keeps within the budget
    cands: list[_Candidate] = [fixed] if c0 in keep and alg in (None, DispatchAlg.MIN_HEAP) else []
    priced = []
    for c in keep[:_PRICED_MAX]:
        more = len(priced) >= _PRICED
        if more and (any(x.remote.max(initial=0) <= budget for x in cands) or -(-geometry(c) // c) > 1024):
            break  # past the first sizes, only small chunk tables are worth another try
        priced.append(c)
        n = -(-geometry(c) // c)
        # the default's comparison assigns by min_heap (cheap: a new mask every step pays for its key); the
        # chunk dispatch of earlier releases, affinity, is there by name
        a = alg or DispatchAlg.MIN_HEAP
        if a is DispatchAlg.MIN_HEAP and c == c0 and cands and cands[0] is fixed:
            continue  # the fixed rule's assignment, already priced
        # affinity may also let a rank run a little over the bound while it collects a document's chunks
        # (the swaps then restore the balance): tried where the chunk table is small, when asked for
        many = a is DispatchAlg.AFFINITY and alg is not None and n <= _TOLERANCE_CHUNKS
        for tol in _TOLERANCES if many else (0.0,):
            plan = _assign(slices, geometry(c), cp, c, a, uneven, tol)
            cands.append(_priced(slices, plan, cp, law, cross))
    # the price weighs balance against fragments and communication; the balance itself stays near the best,
    # and the remote K/V within the budget where a candidate can
    balanced = min(x.plan.imbalance for x in cands) + _BALANCE_SLACK
    ok = [x for x in cands if x.plan.imbalance <= balanced]
    within = [x for x in ok if x.remote.max(initial=0) <= budget]
    if within:
        best = min(within, key=lambda x: (round(x.seconds, 9), -x.chunk_size))
    else:
        best = min(ok, key=lambda x: (int(x.remote.max(initial=0)), round(x.seconds, 9), -x.chunk_size))
    why = (
        f"chunk {best.chunk_size} ({best.plan.alg.value}) has the lowest predicted step "
        f"({best.seconds * 1e3:.3g} ms by the {law.gpu} {law.backend} kernel law) among "
        f"{', '.join(map(str, priced))}"
    )
    if dropped:
        why += f"; {', '.join(map(str, dropped))} cannot balance below {min(bounds[c] for c in dropped):.3f}"
    return best, why + "."


def _size_areas(slices: list, sizes: list[int], geometry) -> list[np.ndarray]:
    """`chunk_areas(slices, geometry(c), c)` for every candidate size `c` (each a multiple of the smallest):
    the smallest size's areas measured once, summed over each larger chunk's smaller ones (areas add up
    exactly over rows; rows past the mask's are padding, of area 0)."""
    if not sizes:
        return []
    fine = min(sizes)
    if any(c % fine for c in sizes):  # not halvings of one size: measure each
        return [chunk_areas(slices, geometry(c), c) for c in sizes]
    base = chunk_areas(slices, max(geometry(c) for c in sizes), fine)
    out = []
    for c in sizes:
        n, f = -(-geometry(c) // c), c // fine
        a = np.zeros(n * f, dtype=np.int64)
        k = min(base.size, a.size)
        a[:k] = base[:k]
        out.append(a.reshape(n, f).sum(axis=1))
    return out
