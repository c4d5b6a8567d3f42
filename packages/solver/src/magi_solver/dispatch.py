"""Dispatch solver: cut the sequence into chunks and give every rank the same number of chunks (within one
with uneven shards), balancing the attention work (the mask area of each chunk's rows).

Self-attention: q and k share one sequence and one dispatch. Rank r's local tokens are its chunks in
ascending chunk id (`DispatchPlan.host_token_ranges(r)`), so the dispatched layout of a global tensor is
`x[plan.permutation]` split into `cp_size` equal shards.

Uneven shards (`uneven_shard=True`): the sequence is not padded. It is cut into `ceil(total / chunk_size)`
chunks, the last one possibly shorter, and the chunk counts of two ranks differ by at most one, so ranks
hold slightly different token counts (never more than a padded plan's shard); the balance by area is the
same problem under those count limits. The short chunk has the largest id, so it is always the last chunk
of its rank: every other chunk starts at `index * chunk_size` of its rank's local tokens.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from .mask import band_area_np, normalize_mask, region_of
from .ranges import AttnRange, AttnRanges, _check_int, _check_positive

__all__ = [
    "DispatchAlg",
    "DispatchPlan",
    "chunk_areas",
    "dispatch_lower_bound",
    "redispatch_areas",
    "solve_dispatch",
    "validate_geometry",
]


class DispatchAlg(StrEnum):
    """How chunks are assigned to ranks.

    MIN_HEAP: largest chunk first to the least-loaded rank that still has room, then swaps of one chunk of
    the most-loaded rank with one of another rank while they lower the maximum (default).
    SEQUENTIAL: contiguous blocks of chunks (plain sequence sharding, for comparison).
    ZIGZAG: the head-tail split of ring attention: 2*cp blocks, rank r gets blocks r and 2*cp-1-r.
    AFFINITY: like MIN_HEAP, but a chunk goes to the rank already holding most of the keys its rows need (or
    whose rows need its keys) as long as that rank stays within the balance lower bound (less communication),
    then MIN_HEAP's swaps restore the balance, then swaps that never raise the maximum load lower the remote
    keys of the rank fetching the most; falls back to MIN_HEAP's assignment when that one needs no more
    (estimated) communication.
    DOCUMENTS: whole units (packed documents, clips, runs of windows) on as few ranks as balance of
    predicted kernel time allows (`magi_solver.documents`); self-attention only.
    """

    MIN_HEAP = "min_heap"
    SEQUENTIAL = "sequential"
    ZIGZAG = "zigzag"
    AFFINITY = "affinity"
    DOCUMENTS = "documents"


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """Which global chunks each rank holds.

    Attributes:
        total_seqlen: tokens in the (padded) global sequence.
        cp_size: number of ranks.
        chunk_size: tokens per chunk (the last chunk is shorter when `uneven_shard` and `chunk_size` does
            not divide `total_seqlen`).
        num_chunks: `total_seqlen // chunk_size` (`ceil(total_seqlen / chunk_size)` with `uneven_shard`).
        partitions: per rank, its sorted global chunk ids (all of equal length `num_chunks // cp_size`;
            with `uneven_shard` the lengths differ by at most one, and no rank is empty).
        chunk_areas: per chunk, the mask area of its rows.
        rank_areas: per rank, the sum of its chunks' areas.
        alg: the algorithm that produced the plan.
        lower_bound: a lower bound on `max(rank_areas)` over every assignment with these chunk counts.
        uneven_shard: the sequence is not padded (see the module docstring).
    """

    total_seqlen: int
    cp_size: int
    chunk_size: int
    num_chunks: int
    partitions: tuple[tuple[int, ...], ...]
    chunk_areas: tuple[int, ...]
    rank_areas: tuple[int, ...]
    alg: DispatchAlg
    lower_bound: int
    uneven_shard: bool = False

    def __post_init__(self) -> None:
        if self.uneven_shard:
            expected = -(-self.total_seqlen // self.chunk_size)
            if self.num_chunks != expected:
                raise ValueError(f"DispatchPlan: num_chunks must be {expected}, got {self.num_chunks}")
            counts = [len(p) for p in self.partitions]
            if len(counts) != self.cp_size or min(counts) == 0 or max(counts) - min(counts) > 1:
                raise ValueError(
                    f"DispatchPlan needs {self.cp_size} non-empty partitions whose chunk counts differ by at "
                    f"most one, got counts {counts}"
                )
        else:
            per = self.num_chunks // self.cp_size
            if len(self.partitions) != self.cp_size or any(len(p) != per for p in self.partitions):
                raise ValueError(
                    f"DispatchPlan needs {self.cp_size} partitions of {per} chunks, got {self.partitions}"
                )
        flat = sorted(c for p in self.partitions for c in p)
        if flat != list(range(self.num_chunks)) or any(list(p) != sorted(p) for p in self.partitions):
            raise ValueError("DispatchPlan partitions must be sorted and hold every chunk exactly once")

    @property
    def chunks_per_rank(self) -> int:
        """Chunks of each rank (the smallest count with `uneven_shard`)."""
        return self.num_chunks // self.cp_size

    @property
    def shard_seqlens(self) -> tuple[int, ...]:
        """Local tokens of each rank (all `shard_seqlen` unless `uneven_shard`)."""
        last, cs = self.num_chunks - 1, self.chunk_size
        short = last * cs + cs - self.total_seqlen  # tokens the last chunk lacks (0 unless uneven)
        return tuple(len(p) * cs - (short if p[-1] == last else 0) for p in self.partitions)

    @property
    def shard_seqlen(self) -> int:
        """Local tokens per rank; with `uneven_shard` the largest of `shard_seqlens` (a buffer size)."""
        if not self.uneven_shard:
            return self.chunks_per_rank * self.chunk_size
        return max(self.shard_seqlens)

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """Global `[start, end)` tokens of `chunk` (the last one may be short with `uneven_shard`)."""
        return chunk * self.chunk_size, min((chunk + 1) * self.chunk_size, self.total_seqlen)

    @property
    def imbalance(self) -> float:
        """max(rank_areas) / mean(rank_areas); 1.0 is perfect (and for an empty mask)."""
        total = sum(self.rank_areas)
        return max(self.rank_areas) * self.cp_size / total if total else 1.0

    @property
    def lower_bound_imbalance(self) -> float:
        """`lower_bound / mean(rank_areas)`: no assignment under the plan's chunk-count limits (equal counts,
        or counts within one with uneven shards) can have a smaller imbalance."""
        total = sum(self.rank_areas)
        return self.lower_bound * self.cp_size / total if total else 1.0

    @property
    def chunk_owner(self) -> tuple[int, ...]:
        owner = [0] * self.num_chunks
        for r, part in enumerate(self.partitions):
            for c in part:
                owner[c] = r
        return tuple(owner)

    def host_token_ranges(self, rank: int) -> AttnRanges:
        """Global token ranges of `rank`'s chunks in local order (adjacent chunks merged)."""
        return AttnRanges(tuple(AttnRange(s, e) for s, e in self.host_pairs(rank)))

    def host_pairs(self, rank: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for c in self.partitions[rank]:
            s, e = self.chunk_range(c)
            if out and out[-1][1] == s:
                out[-1] = (out[-1][0], e)
            else:
                out.append((s, e))
        return out

    def _token_ids(self, chunks: np.ndarray) -> np.ndarray:
        ids = (chunks[:, None] * self.chunk_size + np.arange(self.chunk_size, dtype=np.int64)).ravel()
        return ids[ids < self.total_seqlen] if self.uneven_shard else ids

    def position_ids(self, rank: int) -> np.ndarray:
        """int64 `[shard_seqlens[rank]]`: the global index of each local token (for RoPE)."""
        return self._token_ids(np.asarray(self.partitions[rank], dtype=np.int64))

    @property
    def permutation(self) -> np.ndarray:
        """int64 `[total_seqlen]`: global token ids in dispatched order (rank 0's tokens, then rank 1's, ...)."""
        return self._token_ids(np.concatenate([np.asarray(p, dtype=np.int64) for p in self.partitions]))

    @property
    def unpermutation(self) -> np.ndarray:
        """Inverse of `permutation`: `dispatched[unpermutation]` is the global order again."""
        perm = self.permutation
        inv = np.empty_like(perm)
        inv[perm] = np.arange(perm.size, dtype=np.int64)
        return inv


PLACEMENTS: dict[DispatchAlg, Callable[[list, int, int, int, bool], DispatchPlan]] = {}
"""Algorithms of their own modules built on this one (`documents` registers DOCUMENTS when imported, as
`import magi_solver` does): `(slices, total_seqlen, cp_size, chunk_size, uneven_shard) -> DispatchPlan`."""


def padded_seqlen(total_seqlen: int, cp_size: int, chunk_size: int) -> int:
    """`total_seqlen` rounded up to a multiple of `chunk_size * cp_size`: the padded geometry's length (the
    same number of whole chunks on every rank)."""
    step = chunk_size * cp_size
    return -(-total_seqlen // step) * step


def validate_geometry(
    total_seqlen: Any, cp_size: Any, chunk_size: Any, *, uneven_shard: bool = False
) -> tuple[int, int, int]:
    """Check the sequence / chunk / rank sizes; returns them as ints. Raises ValueError naming the argument.

    Padded geometry (default): `chunk_size * cp_size` divides `total_seqlen`. With `uneven_shard`, any
    `total_seqlen` with at least `cp_size` chunks (`ceil(total_seqlen / chunk_size) >= cp_size`)."""
    total_seqlen = _check_positive(total_seqlen, "total_seqlen")
    cp_size = _check_positive(cp_size, "cp_size")
    chunk_size = _check_positive(chunk_size, "chunk_size")
    if not isinstance(uneven_shard, bool):
        raise TypeError(f"`uneven_shard` must be a bool, got {type(uneven_shard).__name__}")
    if uneven_shard:
        num_chunks = -(-total_seqlen // chunk_size)
        if cp_size > num_chunks:
            raise ValueError(
                f"`cp_size` = {cp_size} is larger than the chunk count {num_chunks} (total_seqlen "
                f"{total_seqlen}, chunk_size {chunk_size}): every rank needs at least one chunk; use a smaller "
                "chunk_size" + ("" if total_seqlen >= cp_size else " (or fewer ranks than tokens)")
            )
        return total_seqlen, cp_size, chunk_size
    if total_seqlen % chunk_size:
        raise ValueError(
            f"`chunk_size` = {chunk_size} must divide `total_seqlen` = {total_seqlen}; pad the sequence to a "
            f"multiple of chunk_size * cp_size = {chunk_size * cp_size}"
        )
    num_chunks = total_seqlen // chunk_size
    if cp_size > num_chunks:
        raise ValueError(
            f"`cp_size` = {cp_size} is larger than the chunk count {num_chunks}; use a smaller chunk_size"
        )
    if num_chunks % cp_size:
        raise ValueError(
            f"`cp_size` = {cp_size} must divide the chunk count {num_chunks} (equal chunks per rank); pad "
            f"total_seqlen to a multiple of chunk_size * cp_size = {chunk_size * cp_size}"
        )
    return total_seqlen, cp_size, chunk_size


def _region_arrays(slices: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    """int64 `[n, 6]` of (qs, qe, ks, ke, lo, hi)."""
    if not slices:
        return np.zeros((0, 6), dtype=np.int64)
    return np.asarray([region_of(*s) for s in slices], dtype=np.int64)


def _row_chunk_pairs(regs: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(region index, chunk id) for every chunk whose rows meet a region's rows."""
    c0 = regs[:, 0] // chunk_size
    c1 = (regs[:, 1] - 1) // chunk_size
    counts = c1 - c0 + 1
    idx = np.repeat(np.arange(len(regs)), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    chunk = c0[idx] + (np.arange(idx.size) - starts)
    return idx, chunk


def chunk_areas(
    slices: list[tuple[int, int, int, int, int]], total_seqlen: int, chunk_size: int
) -> np.ndarray:
    """int64 `[num_chunks]`: mask area of each chunk's rows (vectorised over (slice, chunk) pairs); a last,
    shorter chunk when `chunk_size` does not divide `total_seqlen` (uneven shards)."""
    num_chunks = -(-total_seqlen // chunk_size)
    regs = _region_arrays(slices)
    out = np.zeros(num_chunks, dtype=np.int64)
    if len(regs) == 0:
        return out
    idx, chunk = _row_chunk_pairs(regs, chunk_size)
    r = regs[idx]
    area = band_area_np(
        np.maximum(r[:, 0], chunk * chunk_size),
        np.minimum(r[:, 1], (chunk + 1) * chunk_size),
        r[:, 2],
        r[:, 3],
        r[:, 4],
        r[:, 5],
    )
    np.add.at(out, chunk, area)
    return out


def dispatch_lower_bound(areas: Any, cp_size: int) -> int:
    """Lower bound on the max rank load of any assignment where every rank holds at least
    `m = len(areas) // cp_size` chunks (equal counts, or uneven shards' counts that differ by one).

    Two bounds: the mean load (rounded up), and the largest chunk plus the `m - 1` smallest other chunks
    (its rank holds `m - 1` more chunks).
    """
    a = sorted(int(x) for x in areas)
    m = len(a) // cp_size
    mean_bound = -(-sum(a) // cp_size)
    if not a:
        return 0
    return max(mean_bound, a[-1] + sum(a[: m - 1]))


def _min_heap(areas: list[int], cp_size: int, refine: bool = True) -> list[list[int]]:
    """Largest chunk first to the least-loaded rank with room. Every rank holds `n // cp_size` chunks and,
    when `cp_size` does not divide `n` (uneven shards), `n % cp_size` ranks hold one more."""
    base, extra = divmod(len(areas), cp_size)
    cap = base + (extra > 0)
    order = sorted(range(len(areas)), key=lambda c: (-areas[c], c))
    heap = [(0, r) for r in range(cp_size)]
    parts: list[list[int]] = [[] for _ in range(cp_size)]
    for c in order:
        load, r = heapq.heappop(heap)  # ranks at `cap` are never pushed back
        while len(parts[r]) >= base and extra == 0:  # at `base` once every extra slot is taken: full
            load, r = heapq.heappop(heap)
        parts[r].append(c)
        if len(parts[r]) > base:
            extra -= 1
        if len(parts[r]) < cap:
            heapq.heappush(heap, (load + areas[c], r))
    if refine and cp_size > 1:
        _refine_swaps(areas, parts)
    return parts


_REFINE_MAX_PAIRS = 1 << 22  # entries of the [m, cp, m] swap table per round (32 MiB)
_REFINE_CLOSE_ENOUGH = 1e-4  # relative gap to the lower bound at which the swaps stop


def _refine_swaps(areas: list[int], parts: list[list[int]], max_rounds: int | None = None) -> None:
    """Swap one chunk of the most-loaded rank with one chunk of another rank while both end strictly below
    the old maximum (so the max load never grows); pick the swap that best halves the gap. In place.

    Chunk counts that differ by one (uneven shards) are padded with an empty slot (a sentinel chunk of area
    0) on the ranks holding fewer: a swap with an empty slot moves a chunk from a rank holding more to a
    rank holding fewer, which keeps the counts within one; the other moves through empty slots are masked.
    """
    n = len(areas)
    width = max(len(p) for p in parts)
    a = np.asarray([*areas, 0], dtype=np.int64)  # index n: the empty slot
    mat = np.full((len(parts), width), n, dtype=np.int64)  # [cp, m] chunk ids
    for r, p in enumerate(parts):
        mat[r, : len(p)] = p
    if mat.shape[1] ** 2 * mat.shape[0] > _REFINE_MAX_PAIRS:
        return  # one round would build too large a table; the greedy result stands
    ragged = bool((mat == n).any())
    loads = a[mat].sum(axis=1)
    # within 1e-4 of the lower bound no swap can help enough to pay for another round of the table
    good_enough = dispatch_lower_bound(areas, len(parts)) * (1.0 + _REFINE_CLOSE_ENOUGH)
    for _ in range(max_rounds or 4 * len(parts)):
        if loads.max() <= good_enough:
            break
        top = int(np.argmax(loads))
        gap = loads[top] - loads  # per rank: how much the top rank is above it
        d = a[mat[top]][:, None, None] - a[mat][None, :, :]  # [m(top), cp, m]: area moved top -> rank
        ok = (d > 0) & (d < gap[None, :, None])
        if ragged:
            real = mat != n
            # the top rank gives a real chunk; it may land in an empty slot only if the top rank holds more
            ok &= real[top][:, None, None] & (real[None, :, :] | bool(real[top].all()))
        if not ok.any():
            break
        # best: the new max of the pair, max(top - d, rank + d), as small as possible
        cost = np.where(ok, np.maximum(loads[top] - d, loads[None, :, None] + d), np.iinfo(np.int64).max)
        i, r, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
        mat[top, i], mat[r, j] = mat[r, j], mat[top, i]
        loads[top] -= d[i, r, j]
        loads[r] += d[i, r, j]
    for r in range(len(parts)):
        parts[r] = [int(c) for c in mat[r] if c != n]


def _sequential(num_chunks: int, cp_size: int) -> list[list[int]]:
    """Contiguous blocks; with uneven shards the first `num_chunks % cp_size` ranks hold one chunk more."""
    base, extra = divmod(num_chunks, cp_size)
    starts = [r * base + min(r, extra) for r in range(cp_size + 1)]
    return [list(range(starts[r], starts[r + 1])) for r in range(cp_size)]


def _zigzag(num_chunks: int, cp_size: int, uneven_shard: bool = False) -> list[list[int]]:
    if uneven_shard:
        # 2*cp contiguous blocks whose sizes differ by at most one (the first ones larger); rank r takes
        # blocks r and 2*cp-1-r, so chunk counts differ by at most one and no rank is empty
        starts = _sequential(num_chunks, 2 * cp_size)
        return [starts[r] + starts[2 * cp_size - 1 - r] for r in range(cp_size)]
    per = num_chunks // cp_size
    if per % 2:
        raise ValueError(
            f"alg='zigzag' needs an even number of chunks per rank, got {per} (num_chunks {num_chunks}, "
            f"cp_size {cp_size}); halve `chunk_size`"
        )
    h = per // 2
    return [
        list(range(r * h, (r + 1) * h)) + list(range((2 * cp_size - 1 - r) * h, (2 * cp_size - r) * h))
        for r in range(cp_size)
    ]


def _key_intervals(
    slices: list[tuple[int, int, int, int, int]], chunk_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per (slice, chunk) piece with area: (chunk id, q length, key start, key end) of the keys its rows need."""
    regs = _region_arrays(slices)
    if len(regs) == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    idx, chunk = _row_chunk_pairs(regs, chunk_size)
    qs, qe, ks, ke, lo, hi = (regs[idx, i] for i in range(6))
    a = np.maximum(np.maximum(qs, chunk * chunk_size), ks - hi)
    b = np.minimum(np.minimum(qe, (chunk + 1) * chunk_size), ke - lo)
    kl = np.maximum(ks, a + lo)
    kr = np.minimum(ke, b + hi)
    ok = (a < b) & (kl < kr)
    return chunk[ok], (b - a)[ok], kl[ok], kr[ok]


def _key_need_matrix(
    slices: list[tuple[int, int, int, int, int]], num_chunks: int, chunk_size: int
) -> np.ndarray:
    """float32 `[num_chunks, num_chunks]`: keys of chunk j needed by the rows of chunk i (overlaps add up)."""
    need = np.zeros((num_chunks, num_chunks + 1), dtype=np.float32)
    chunk, _, kl, kr = _key_intervals(slices, chunk_size)
    if chunk.size == 0:
        return need[:, :-1]
    j0, j1 = kl // chunk_size, (kr - 1) // chunk_size
    same = j0 == j1
    np.add.at(need, (chunk[same], j0[same]), (kr - kl)[same])
    diff = ~same
    c, j0, j1, kl, kr = chunk[diff], j0[diff], j1[diff], kl[diff], kr[diff]
    np.add.at(need, (c, j0), (j0 + 1) * chunk_size - kl)
    np.add.at(need, (c, j1), kr - j1 * chunk_size)
    # full middle chunks j0+1 .. j1-1 through a difference array along j
    mid = np.zeros_like(need)
    np.add.at(mid, (c, j0 + 1), chunk_size)
    np.add.at(mid, (c, j1), -chunk_size)
    np.cumsum(mid, axis=1, out=mid)
    need += mid
    del mid
    return need[:, :-1]


_AFFINITY_MAX_CHUNKS = 4096  # float32 table of 64 MiB


def _affinity(
    areas: list[int],
    cp_size: int,
    slices: list[tuple[int, int, int, int, int]],
    chunk_size: int,
    tolerance: float,
) -> list[list[int]]:
    """Largest chunk first; among ranks with room whose load stays within `(1 + tolerance) * lower bound`,
    take the one with the most affinity (keys its rows need, or rows that need its keys); with no such rank,
    or no affinity anywhere, the least-loaded rank (MIN_HEAP's choice)."""
    n = len(areas)
    base, extra = divmod(n, cp_size)  # counts: base each, `extra` ranks one more (uneven shards)
    if n > _AFFINITY_MAX_CHUNKS:
        raise ValueError(
            f"alg='affinity' keeps a num_chunks x num_chunks affinity table; {n} chunks is more than "
            f"{_AFFINITY_MAX_CHUNKS}: use a larger `chunk_size` or alg='min_heap'"
        )
    need = np.ascontiguousarray(_key_need_matrix(slices, n, chunk_size))
    sym = need + need.T
    aff = np.zeros((cp_size, n), dtype=np.float32)
    loads = np.zeros(cp_size, dtype=np.int64)
    counts = np.zeros(cp_size, dtype=np.int64)
    target = dispatch_lower_bound(areas, cp_size) * (1.0 + tolerance)
    parts: list[list[int]] = [[] for _ in range(cp_size)]
    for c in sorted(range(n), key=lambda c: (-areas[c], c)):
        open_ranks = np.flatnonzero((counts < base) | ((counts == base) & (extra > 0)))
        fits = open_ranks[loads[open_ranks] + areas[c] <= target]
        score = aff[fits, c] if fits.size else np.zeros(0, dtype=np.float32)
        if fits.size and score.max() > 0:
            best = fits[score == score.max()]
        else:
            best = open_ranks
        r = int(best[np.argmin(loads[best])])  # least loaded among the best (then lowest id)
        parts[r].append(c)
        counts[r] += 1
        extra -= int(counts[r] > base)
        loads[r] += areas[c]
        aff[r] += sym[c]
    # the greedy keeps every rank within the bound while it can; the last, smallest chunks may still land
    # above it: swaps of one chunk (the ones min-heap refines with) restore the balance
    if cp_size > 1:
        _refine_swaps(areas, parts)
        # then swaps that lower the busiest fetcher's remote keys without raising the balanced maximum
        _comm_swaps(need, areas, parts, max(sum(areas[c] for c in p) for p in parts))
    # The greedy can lose to plain min-heap on both counts (e.g. block-causal video, where every late block
    # needs every earlier one): then min-heap's assignment is strictly better, so return it.
    heap = _min_heap(areas, cp_size)
    if _estimated_comm(need, heap) <= _estimated_comm(need, parts):
        return heap
    return parts


_COMM_SWAP_CANDIDATES = 64
"""Chunks of other ranks a comm swap considers per round (those that add the fewest remote keys)."""


def _needs_top2(need: np.ndarray, chunks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key chunk: the largest and second largest need of `chunks`' rows, and the chunk with the largest."""
    rows = need[chunks]
    arg = rows.argmax(axis=0)
    cols = np.arange(rows.shape[1])
    top1 = rows[arg, cols]
    if len(chunks) > 1:
        rest = rows.copy()
        rest[arg, cols] = -1.0
        top2 = rest.max(axis=0)
    else:
        top2 = np.zeros_like(top1)
    return top1, np.maximum(top2, 0.0), np.asarray(chunks, dtype=np.int64)[arg]


def _comm_swaps(need: np.ndarray, areas: list[int], parts: list[list[int]], cap: int) -> None:
    """Swap one chunk of the rank with the most estimated remote keys (`_estimated_comm`'s per-rank term)
    with one chunk of another rank while the larger estimate of the two ends below the old maximum and both
    loads stay within `cap` (so the balance never gets worse); at most `2 * cp` swaps. In place.

    The balancing swaps ignore affinity and scatter a long document's chunks over more ranks than the
    balance needs; these swaps bring the chunks its busiest fetcher needs back to it. Each round scores the
    other ranks' chunks by the keys they would add to that rank, and prices the `_COMM_SWAP_CANDIDATES`
    best against each of the rank's chunks exactly (both ranks' estimates after the swap)."""
    n, cp = need.shape[0], len(parts)
    area = np.asarray(areas, dtype=np.int64)
    owner = np.empty(n, dtype=np.int64)
    for r, p in enumerate(parts):
        owner[p] = r
    loads = np.asarray([area[p].sum() for p in parts], dtype=np.int64)
    tops = [_needs_top2(need, p) for p in parts]
    nz_r, nz_c = np.nonzero(need)  # the candidates' scores walk the needs that are there (few for documents)
    nz_v = need[nz_r, nz_c]
    comms = np.asarray([float(t[0].sum() - t[0][p].sum()) for t, p in zip(tops, parts)])
    for _ in range(2 * cp):
        r = int(np.argmax(comms))
        P = np.asarray(parts[r], dtype=np.int64)
        top1, top2, arg1 = tops[r]
        own = owner == r
        # b's from other ranks that add the fewest keys to r's estimate (b's own column becomes owned)
        add = np.where(own[nz_c] | (nz_r == nz_c), 0.0, np.maximum(nz_v - top1[nz_c], 0.0))
        delta = np.bincount(nz_r, add, minlength=n) - top1
        delta[own] = np.inf
        k = min(_COMM_SWAP_CANDIDATES, n - P.size)
        if k <= 0:
            break
        B = np.argpartition(delta, k - 1)[:k]
        S = owner[B]
        mi, bi = np.arange(P.size)[:, None], np.arange(B.size)[None, :]
        rows_p, rows_b = need[P], need[B]
        # max(x, y) = x + max(0, y - x): the second term only where an added chunk needs keys (`cols`)
        cols = np.flatnonzero((rows_p > 0).any(axis=0) | (rows_b > 0).any(axis=0))
        # r gives a (rows of P), takes b: its column of a is no longer owned, b's is
        wo_a = np.where(arg1[None, :] == P[:, None], top2[None, :], top1[None, :])  # [m, n]
        extra = np.maximum(rows_b[None, :, cols] - wo_a[:, None, cols], 0.0)  # [m, k, J]
        base = np.where(own, 0.0, wo_a).sum(axis=1)[:, None]
        comm_r = base + np.where(own[cols], 0.0, extra).sum(axis=2)
        comm_r += np.maximum(wo_a[mi, P[:, None]], rows_b[bi, P[:, None]])  # a's column
        comm_r -= np.maximum(wo_a[mi, B[None, :]], rows_b[bi, B[None, :]])  # b's column
        # s (b's owner) gives b, takes a
        s1 = np.stack([tops[x][0] for x in S.tolist()])
        s2 = np.stack([tops[x][1] for x in S.tolist()])
        sa = np.stack([tops[x][2] for x in S.tolist()])
        wo_b = np.where(sa == B[:, None], s2, s1)  # [k, n]
        own_s = owner[None, :] == S[:, None]  # [k, n]
        extra = np.maximum(rows_p[:, None, cols] - wo_b[None, :, cols], 0.0)  # [m, k, J]
        base = np.where(own_s, 0.0, wo_b).sum(axis=1)[None, :]
        comm_s = base + np.where(own_s[None, :, cols], 0.0, extra).sum(axis=2)
        comm_s += np.maximum(wo_b[bi, B[None, :]], rows_p[mi, B[None, :]])  # b's column
        comm_s -= np.maximum(wo_b[bi, P[:, None]], rows_p[mi, P[:, None]])  # a's column
        moved = area[P][:, None] - area[B][None, :]
        ok = (loads[r] - moved <= cap) & (loads[S][None, :] + moved <= cap)
        worst = np.where(ok, np.maximum(comm_r, comm_s), np.inf)
        i, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if not worst[i, j] < comms[r] - 0.5:  # estimates count tokens: at least one fewer, or stop
            break
        a, b, s = int(P[i]), int(B[j]), int(S[j])
        parts[r][parts[r].index(a)] = b
        parts[s][parts[s].index(b)] = a
        owner[a], owner[b] = s, r
        loads[r] -= moved[i, j]
        loads[s] += moved[i, j]
        for x in (r, s):
            tops[x] = _needs_top2(need, parts[x])
            comms[x] = float(tops[x][0].sum() - tops[x][0][parts[x]].sum())


def _estimated_comm(need: np.ndarray, parts: list[list[int]]) -> float:
    """Max over ranks of the remote keys it fetches, at chunk granularity: for each chunk it does not hold,
    the most keys any of its own chunks needs from it (key sets of one document's rows nest)."""
    worst = 0.0
    own = np.zeros(need.shape[1], dtype=bool)
    for p in parts:
        own[:] = False
        own[p] = True
        worst = max(worst, float(need[p].max(axis=0)[~own].sum()))
    return worst


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
