"""The dispatch's result and geometry: `DispatchPlan` (which chunks each rank holds), the algorithm names
(`DispatchAlg`) and the sequence / chunk / rank size rules (`validate_geometry`, `padded_seqlen`).

Rank r's local tokens are its chunks in ascending chunk id (`DispatchPlan.host_token_ranges(r)`), so the
dispatched layout of a global tensor is `x[plan.permutation]` split into `cp_size` shards.

Uneven shards (`uneven_shard=True`): the sequence is not padded. It is cut into `ceil(total / chunk_size)`
chunks, the last one possibly shorter, and the chunk counts of two ranks differ by at most one, so ranks
hold slightly different token counts (never more than a padded plan's shard). The short chunk has the
largest id, so it is always the last chunk of its rank: every other chunk starts at `index * chunk_size` of
its rank's local tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from .ranges import AttnRange, AttnRanges, _check_positive

__all__ = ["DispatchAlg", "DispatchPlan", "padded_seqlen", "validate_geometry"]


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
        """The rank holding each chunk (`num_chunks` entries)."""
        owner = np.zeros(self.num_chunks, dtype=np.int64)
        for r, part in enumerate(self.partitions):
            owner[list(part)] = r
        return tuple(owner.tolist())

    def host_token_ranges(self, rank: int) -> AttnRanges:
        """Global token ranges of `rank`'s chunks in local order (adjacent chunks merged)."""
        return AttnRanges(tuple(AttnRange(s, e) for s, e in self.host_pairs(rank)))

    def host_pairs(self, rank: int) -> list[tuple[int, int]]:
        """`host_token_ranges(rank)` as `(start, end)` int pairs (runs of consecutive chunks merged)."""
        chunks = np.asarray(self.partitions[rank], dtype=np.int64)
        if chunks.size == 0:
            return []
        # a run starts at a chunk whose predecessor in the partition is not the chunk just before it
        new = np.ones(chunks.size, dtype=bool)
        new[1:] = chunks[1:] != chunks[:-1] + 1
        first = chunks[new]
        last = chunks[np.append(new[1:], True)]
        ends = np.minimum((last + 1) * self.chunk_size, self.total_seqlen)
        return list(zip((first * self.chunk_size).tolist(), ends.tolist(), strict=True))

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
