"""Dispatch layouts: where every token lives after dispatch, a pure function of a key's mask, sizes, cp size
and dispatch config (no communication), and the per-rank token counts keys report.

The one private module outside `_runtime/`: it sits below `key.py` (keys read their local lengths from it),
which sits below the runtime (`_runtime.cache` caches full layouts with their plans). It needs only the
planner, reads a key by attribute and never imports the key module.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from magi_solver import (
    DispatchChoice,
    DispatchPlan,
    KVLayout,
    PreparedDispatch,
    default_chunk_size,
    padded_seqlen,
    prepare_dispatch,
)

from ._lru import remember


def choose_chunk_size(total_seqlen: int, cp_size: int, chunk_size: int | None) -> int:
    """The user's chunk size, or the largest one the per-mask choice considers (`default_chunk_size`:
    min(2048, ceil(total / (8 * cp)))). The chosen size never pads the sequence more than this one, so it
    bounds the padded length before the mask is looked at (the key checks and the key/value shards use it)."""
    if chunk_size is not None:
        return chunk_size
    return default_chunk_size(total_seqlen, cp_size)


@dataclass(frozen=True, slots=True)
class DispatchLayout:
    """Where every token lives after dispatch. Tokens past `total_seqlen` are padding (no keys, zero rows);
    with uneven shards there is no padding and ranks hold different token counts."""

    total_seqlen: int
    padded_seqlen: int
    """`total_seqlen` rounded up to a multiple of chunk_size * cp_size (`total_seqlen` with uneven shards)."""
    shard_seqlens: tuple[int, ...]
    """Local (query-side) tokens of each rank; all equal unless uneven shards."""
    cp_size: int
    chunk_size: int
    permutation: np.ndarray
    """int64 [padded_seqlen]: global token id of each dispatched position (rank 0's tokens first)."""
    dispatch_plan: DispatchPlan | None
    kv_layout: KVLayout | None = None
    """Cross-attention: the key/value sequence's contiguous shards (None: keys are the queries' tokens)."""
    kv_total_seqlen: int | None = None
    """Cross-attention: tokens of the key/value sequence before padding."""
    choice: DispatchChoice | None = None
    """How the chunk size and algorithm were chosen (None at cp 1)."""

    @property
    def shard_seqlen(self) -> int:
        """The largest local token count (every rank's, unless uneven shards): a buffer size."""
        return max(self.shard_seqlens)

    @property
    def shard_offsets(self) -> tuple[int, ...]:
        """Dispatched position of each rank's first token, and `padded_seqlen` at the end."""
        return (0, *itertools.accumulate(self.shard_seqlens))

    def local_token_ids(self, rank: int) -> np.ndarray:
        offsets = self.shard_offsets
        return self.permutation[offsets[rank] : offsets[rank + 1]]

    @property
    def kv_shard_seqlens(self) -> tuple[int, ...]:
        """Key/value tokens each rank holds (its query shard in self-attention)."""
        return self.shard_seqlens if self.kv_layout is None else self.kv_layout.shard_seqlens

    @property
    def kv_shard_seqlen(self) -> int:
        """The largest of `kv_shard_seqlens` (every rank's, unless uneven shards)."""
        return max(self.kv_shard_seqlens)


def _padded(total: int, cp: int, chunk: int, uneven: bool) -> int:
    """The planned length: a multiple of chunk * cp, or the sequence itself (uneven shards, or cp 1)."""
    return total if uneven or cp == 1 else padded_seqlen(total, cp, chunk)


def _kv_layout(total_k: int, cp: int, dispatch_cfg: Any) -> KVLayout:
    """Cross-attention's keys/values: contiguous shards of their own (padded) sequence, balanced by token
    count."""
    uneven = dispatch_cfg.uneven_shard
    kv_chunk = total_k if cp == 1 else choose_chunk_size(total_k, cp, dispatch_cfg.chunk_size)
    if uneven and cp > 1:  # no padding: a short key/value sequence still needs a chunk on every rank
        kv_chunk = min(kv_chunk, max(1, math.ceil(total_k / cp)))
    try:
        return KVLayout(_padded(total_k, cp, kv_chunk, uneven), cp, kv_chunk, uneven and cp > 1)
    except ValueError as exc:  # the solver names its own argument, `total_seqlen`
        raise ValueError(f"key/value side (total_seqlen_k={total_k}): {exc}") from None


def _solve(mask: Any, total: int, cp: int, dispatch_cfg: Any, kv: KVLayout | None) -> PreparedDispatch:
    """The dispatch of `mask` (`(q_ranges, k_ranges, types)`) as the runtime solves it (magi_solver caches it
    per mask, cp size and config, and the plan reuses it; an adopted `prepare_dispatch` answers it)."""
    q_ranges, k_ranges, types = mask
    return prepare_dispatch(
        [list(r) for r in q_ranges],
        [list(r) for r in k_ranges],
        list(types),
        total,
        cp,
        chunk_size=dispatch_cfg.chunk_size,
        dispatch_alg=dispatch_cfg.alg,  # None: chosen (with an explicit chunk size: min_heap, in the solver)
        uneven_shard=dispatch_cfg.uneven_shard,
        total_seqlen_k=None if kv is None else kv.total_seqlen,
    )


def solve_dispatch_ahead(
    mask: Any, total_q: int, total_k: int, cp: int, dispatch_cfg: Any
) -> PreparedDispatch:
    """What `build_layout` solves for a key of this mask (`(q_ranges, k_ranges, types)`, as a key holds it),
    sizes, cp size and dispatch config, as a value another process can adopt (`magi_solver.adopt_dispatch`).
    """
    kv = _kv_layout(total_k, cp, dispatch_cfg) if total_k != total_q else None
    return _solve(mask, total_q, cp, dispatch_cfg, kv)


def build_layout(key: Any) -> DispatchLayout:
    """Dispatch of the key's own mask (`key`: a root `DistAttnRuntimeKey`, read by attribute: this module sits
    below `key.py`). A pure function of the key: no communication."""
    cp = key.cp_size
    total = key.total_seqlen_q
    dispatch_cfg = key.config.dispatch_config
    kv, kv_total = None, None
    if key.is_cross_attention:
        kv_total = key.total_seqlen_k
        kv = _kv_layout(kv_total, cp, dispatch_cfg)
    if cp == 1:
        return DispatchLayout(
            total, total, (total,), 1, total, np.arange(total, dtype=np.int64), None, kv, kv_total
        )
    solved = _solve((key.q_ranges, key.k_ranges, key.attn_mask_type), total, cp, dispatch_cfg, kv)
    dplan = solved.plan
    return DispatchLayout(
        total,
        dplan.total_seqlen,
        dplan.shard_seqlens,
        cp,
        dplan.chunk_size,
        dplan.permutation,
        dplan,
        kv,
        kv_total,
        solved.choice,
    )


@dataclass(frozen=True, slots=True)
class LayoutLengths:
    """What a key reports about its dispatch: per-rank token counts and the padding appended."""

    shard_seqlens: tuple[int, ...]
    kv_shard_seqlens: tuple[int, ...]
    pad_size: int

    @classmethod
    def of(cls, layout: DispatchLayout) -> LayoutLengths:
        return cls(layout.shard_seqlens, layout.kv_shard_seqlens, layout.padded_seqlen - layout.total_seqlen)


_LENGTHS: OrderedDict[Any, LayoutLengths] = OrderedDict()
# a few ints per root key: room for far more keys than the runtime cache holds (1000 by default), so a
# cached key never re-solves its dispatch to report its lengths
_LENGTHS_SIZE = 8192


def remember_lengths(root: Any, layout: DispatchLayout) -> None:
    """Record a built layout's lengths for `root` (the runtime cache calls this when it builds one)."""
    remember(_LENGTHS, root, LayoutLengths.of(layout), _LENGTHS_SIZE)


def layout_lengths(key: Any) -> LayoutLengths:
    """The lengths of `key`'s dispatch (its root key's): recorded when the runtime built the layout, else
    computed now (the same deterministic solve, on this rank alone)."""
    root = key.root_key
    hit = _LENGTHS.get(root)
    if hit is None:
        remember_lengths(root, build_layout(root))
        hit = _LENGTHS[root]
    else:
        _LENGTHS.move_to_end(root)  # least recently used goes first
    return hit
