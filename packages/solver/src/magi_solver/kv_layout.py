"""Where keys and values live when they are sharded apart from the queries (cross-attention).

Queries are dispatched by mask area (`DispatchPlan`); keys and values of a different sequence are cut into
chunks and split into contiguous, equal shards: balanced by token count, which is what their memory and the
K/V traffic follow (the compute balance is the query side's job). With `uneven_shard` the key sequence is
not padded: `ceil(total / chunk_size)` chunks (the last one possibly short), contiguous blocks whose chunk
counts differ by at most one (the first `num_chunks % cp_size` ranks hold one more).
"""

from __future__ import annotations

from dataclasses import dataclass

from .dispatch import validate_geometry
from .ranges import AttnRange, AttnRanges

__all__ = ["KVLayout"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Contiguous shards of a key/value sequence.

    Attributes:
        total_seqlen: key/value tokens: padded to a multiple of `chunk_size * cp_size`, or (with
            `uneven_shard`) the real count, at least one chunk per rank.
        cp_size: ranks.
        chunk_size: tokens per chunk (the unit GroupCast runs are cut at).
        uneven_shard: no padding; shards differ by at most one chunk.
    """

    total_seqlen: int
    cp_size: int
    chunk_size: int
    uneven_shard: bool = False

    def __post_init__(self) -> None:
        validate_geometry(self.total_seqlen, self.cp_size, self.chunk_size, uneven_shard=self.uneven_shard)

    @property
    def num_chunks(self) -> int:
        return -(-self.total_seqlen // self.chunk_size)

    def _chunk_starts(self) -> list[int]:
        """First chunk of each rank, and `num_chunks` at the end."""
        base, extra = divmod(self.num_chunks, self.cp_size)
        return [r * base + min(r, extra) for r in range(self.cp_size + 1)]

    @property
    def shard_seqlens(self) -> tuple[int, ...]:
        """Key/value tokens of each rank."""
        return tuple(e - s for s, e in (self.host_pairs(r)[0] for r in range(self.cp_size)))

    @property
    def shard_seqlen(self) -> int:
        """Key/value tokens per rank (with `uneven_shard`: the largest of `shard_seqlens`, a buffer size)."""
        if not self.uneven_shard:
            return self.total_seqlen // self.cp_size
        return max(self.shard_seqlens)

    @property
    def chunk_owner(self) -> tuple[int, ...]:
        starts = self._chunk_starts()
        return tuple(r for r in range(self.cp_size) for _ in range(starts[r], starts[r + 1]))

    def chunk_local_offsets(self) -> list[int]:
        """Offset of each chunk inside its owner's shard."""
        starts = self._chunk_starts()
        return [
            (c - starts[r]) * self.chunk_size
            for r in range(self.cp_size)
            for c in range(starts[r], starts[r + 1])
        ]

    def host_pairs(self, rank: int) -> list[tuple[int, int]]:
        starts = self._chunk_starts()
        s = starts[rank] * self.chunk_size
        return [(s, min(starts[rank + 1] * self.chunk_size, self.total_seqlen))]

    def host_token_ranges(self, rank: int) -> AttnRanges:
        """Global key ranges of `rank`'s shard (one range)."""
        return AttnRanges(tuple(AttnRange(s, e) for s, e in self.host_pairs(rank)))
