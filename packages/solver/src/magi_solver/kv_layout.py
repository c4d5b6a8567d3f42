"""Where keys and values live when they are sharded apart from the queries (cross-attention).

Queries are dispatched by mask area (`DispatchPlan`); keys and values of a different sequence are cut into
chunks and split into contiguous, equal shards: balanced by token count, which is what their memory and the
K/V traffic follow (the compute balance is the query side's job).
"""

from __future__ import annotations

from dataclasses import dataclass

from .dispatch import validate_geometry
from .ranges import AttnRange, AttnRanges

__all__ = ["KVLayout"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Contiguous equal shards of a (padded) key/value sequence.

    Attributes:
        total_seqlen: padded key/value tokens, a multiple of `chunk_size * cp_size`.
        cp_size: ranks.
        chunk_size: tokens per chunk (the unit GroupCast runs are cut at).
    """

    total_seqlen: int
    cp_size: int
    chunk_size: int

    def __post_init__(self) -> None:
        validate_geometry(self.total_seqlen, self.cp_size, self.chunk_size)

    @property
    def shard_seqlen(self) -> int:
        return self.total_seqlen // self.cp_size

    @property
    def num_chunks(self) -> int:
        return self.total_seqlen // self.chunk_size

    @property
    def chunk_owner(self) -> tuple[int, ...]:
        per = self.num_chunks // self.cp_size
        return tuple(c // per for c in range(self.num_chunks))

    def chunk_local_offsets(self) -> list[int]:
        """Offset of each chunk inside its owner's shard."""
        per = self.num_chunks // self.cp_size
        return [(c % per) * self.chunk_size for c in range(self.num_chunks)]

    def host_pairs(self, rank: int) -> list[tuple[int, int]]:
        s = rank * self.shard_seqlen
        return [(s, s + self.shard_seqlen)]

    def host_token_ranges(self, rank: int) -> AttnRanges:
        """Global key ranges of `rank`'s shard (one range)."""
        return AttnRanges(tuple(AttnRange(s, e) for s, e in self.host_pairs(rank)))
