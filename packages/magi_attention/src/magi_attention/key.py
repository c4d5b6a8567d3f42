"""`DistAttnRuntimeKey`: the hashable identity of one distributed-attention plan.

A key holds the mask (as plain tuples), the shapes, the process group's identity and the config. It
hashes by value, so equal keys built independently on every rank hit the same cached plan; the group
object itself is carried along but excluded from equality (ranks' `ProcessGroup` objects are not
comparable across calls, their names and rank lists are).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch.distributed as dist

from magi_group_collective import GroupCollectiveImpl

from ._layout import layout_lengths
from .config import DistAttnConfig

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class CollectiveChoice:
    """A key's group-collective implementation and the setting that chose it (made when the key is built:
    `magi_attention._runtime.collective_choice.choose_collective`)."""

    impl: GroupCollectiveImpl
    setting: str
    """The setting that decided, as errors name it (e.g. ``MAGI_ATTENTION_NATIVE_GRPCOLL=1``)."""
    native_buffer_mb: int | None = None
    """MAGI_GROUP_COLLECTIVE_NATIVE_BUFFER_MB when native (every rank must map the same buffer size)."""


@dataclass(frozen=True, slots=True)
class CpGroup:
    """The context-parallel group a key belongs to (`group` None means single process, cp_size 1)."""

    name: str
    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...] | None = None
    group: Any = field(default=None, compare=False, hash=False, repr=False)
    mesh: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def local_rank(self) -> int:
        """This process's rank inside the group; ValueError if it is not a member."""
        if self.group is None:
            return 0
        rank = dist.get_rank(self.group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not in the key's cp group {self.name!r} "
                f"(ranks {list(self.ranks)}): the key was built for another group"
            )
        return rank


@dataclass(frozen=True, slots=True)
class DistAttnRuntimeKey:
    """Identity of a distributed-attention plan. Build it with `magi_attn_flex_key` / `magi_attn_varlen_key`."""

    q_ranges: Ranges
    k_ranges: Ranges
    attn_mask_type: tuple[int, ...]
    total_seqlen_q: int
    total_seqlen_k: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    cp_group: CpGroup
    config: DistAttnConfig
    collective: CollectiveChoice | None
    """The group-collective implementation of the key's plans (`magi_attention._runtime.collective_choice.choose_collective`, made
    when the key is built); None on a single-rank group, which has no collectives."""
    dispatch_key: DistAttnRuntimeKey | None = None
    """For a mask added after dispatch: the key whose dispatch (token placement) this mask reuses."""
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Every calc_attn / dispatch call looks its key up (runtime cache, tags, agreement); the mask's tuples
        # can hold thousands of ranges (244 us per lookup at 4096 slices, hashed anew), so hash once.
        compared = tuple(getattr(self, f.name) for f in fields(self) if f.compare)
        object.__setattr__(self, "_hash", hash(compared))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt (and re-hashed) on unpickling: str hashes differ between processes
        return type(self), tuple(getattr(self, f.name) for f in fields(self) if f.init)

    @property
    def cp_size(self) -> int:
        return self.cp_group.size

    @property
    def is_cross_attention(self) -> bool:
        """Keys and values come from another sequence than the queries (of another length)."""
        return self.total_seqlen_q != self.total_seqlen_k

    @property
    def root_key(self) -> DistAttnRuntimeKey:
        """The key that owns the dispatch (itself unless this mask was made after dispatch)."""
        return self if self.dispatch_key is None else self.dispatch_key.root_key

    # -- what dispatch does with the tokens (from the dispatch layout; no communication) ---------------------
    @property
    def uneven_shard(self) -> bool:
        """`DispatchConfig.uneven_shard` of the key's config: no padding, per-rank token counts differ."""
        return self.config.dispatch_config.uneven_shard

    @property
    def shard_seqlens(self) -> tuple[int, ...]:
        """Tokens each rank of the cp group holds after `dispatch`, in group rank order (all equal unless
        `uneven_shard`; padding included)."""
        return layout_lengths(self).shard_seqlens

    @property
    def shard_seqlen(self) -> int:
        """Tokens this rank holds after `dispatch` (the length of `dispatch(x, key)` on dim 0)."""
        return self.shard_seqlens[self.cp_group.local_rank()]

    @property
    def kv_shard_seqlens(self) -> tuple[int, ...]:
        """Key/value tokens each rank holds after `dispatch_kv` (`shard_seqlens` in self-attention)."""
        return layout_lengths(self).kv_shard_seqlens

    @property
    def kv_shard_seqlen(self) -> int:
        """Key/value tokens this rank holds after `dispatch_kv`."""
        return self.kv_shard_seqlens[self.cp_group.local_rank()]

    @property
    def pad_size(self) -> int:
        """Padding tokens dispatch appends to the query sequence (0 with `uneven_shard` or cp_size 1)."""
        return layout_lengths(self).pad_size
