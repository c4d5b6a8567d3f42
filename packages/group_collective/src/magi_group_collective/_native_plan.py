"""Index tables of the native (symmetric-memory) GroupCast / GroupReduce: pure functions of every rank's
tables, host side, no communication.

Both collectives *pull*: every rank first copies ("stages") the input pieces that other ranks need into its
own symmetric buffer, once per piece whatever the number of destinations; after a barrier every receiver
reads what it needs straight from the owners' buffers into its output rows (GroupCast) or reduces it into
them (GroupReduce). Pieces a rank sends to itself are never staged: the receiver reads them from its own
``input``. The receiver therefore needs the staging layout of every source, which is why the native plans
gather all tables once at construction.

Row addresses in the tables: ``src_row`` is a row of the source's *staging area* when the source is another
rank, and a row of the receiver's own ``input`` when the source is the receiver itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._tables import CastTables, ReduceTables, offsets


def cast_staged_pieces(t: CastTables, rank: int) -> list[int]:
    """Input pieces of ``rank`` that go to at least one *other* rank, in piece order (its staging order)."""
    return [i for i, ds in enumerate(t.dst_indices) if any(d != rank for d in ds)]


def reduce_staged_pieces(t: ReduceTables, rank: int) -> list[int]:
    """Input pieces of ``rank`` whose destination is another rank, in piece order (its staging order)."""
    return [i for i, d in enumerate(t.dst_index) if d != rank]


def staging_offsets(sizes: Sequence[int], pieces: Sequence[int]) -> dict[int, int]:
    """Row where each staged piece starts in the staging area (pieces packed in the given order)."""
    out, acc = {}, 0
    for i in pieces:
        out[i] = acc
        acc += sizes[i]
    return out


def _rows(starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """int64 row ids of the concatenated ranges ``[start, start + size)`` (host)."""
    if not sizes:
        return torch.empty(0, dtype=torch.int64)
    st = torch.tensor(starts, dtype=torch.int64)
    sz = torch.tensor(sizes, dtype=torch.int64)
    shift = torch.cumsum(sz, 0) - sz - st
    return torch.arange(int(sz.sum()), dtype=torch.int64) - torch.repeat_interleave(shift, sz)


@dataclass(frozen=True, slots=True)
class NativeCastLayout:
    """One rank's native GroupCast tables (host tensors; the runner moves them to its device).

    Attributes:
        stage_rows: ``[S]`` int64, input rows copied into the staging area, in staging order.
        src_rank: ``[n_out_tokens]`` int32, source rank of every output row.
        src_row: ``[n_out_tokens]`` int64, row of the source's staging area (or of this rank's input when
            the source is this rank) that every output row is copied from.
        max_stage_rows: largest staging area over all ranks (identical on every rank: sizes the buffer).
        remote: True when some rank reads from another rank (False: a purely local copy, no barrier).
    """

    stage_rows: torch.Tensor
    src_rank: torch.Tensor
    src_row: torch.Tensor
    max_stage_rows: int
    remote: bool


@dataclass(frozen=True, slots=True)
class NativeReduceLayout:
    """One rank's native GroupReduce tables (host tensors), a CSR over the output rows that receive data.

    Attributes:
        stage_rows: ``[S]`` int64, input rows copied into the staging area, in staging order.
        touched: ``[T]`` int64, increasing output rows with at least one contribution.
        ptr: ``[T + 1]`` int64, contributions of ``touched[t]`` are ``ptr[t] .. ptr[t + 1]``.
        c_src: ``[K]`` int32, source rank of every contribution (increasing within a row: the fixed order).
        c_row: ``[K]`` int64, its row in the source's staging area (or in this rank's input, for itself).
        avg_weight: ``[T]`` fp32, ``1 / number of sources`` of each touched row (``reduce_op="avg"``).
        max_stage_rows: largest staging area over all ranks.
        remote: True when some rank reads from another rank.
    """

    stage_rows: torch.Tensor
    touched: torch.Tensor
    ptr: torch.Tensor
    c_src: torch.Tensor
    c_row: torch.Tensor
    avg_weight: torch.Tensor
    max_stage_rows: int
    remote: bool


def _stage_rows(sizes: Sequence[int], pieces: Sequence[int]) -> torch.Tensor:
    off = offsets(sizes)
    return _rows([off[i] for i in pieces], [sizes[i] for i in pieces])


def _staging(all_tables: Sequence, rank: int, staged_pieces) -> tuple[list, list, list[int], list]:
    """Per source rank: the input pieces it stages (``staged_pieces(tables, source)``), their offsets in its
    staging slot and its staged row count; and the pieces each source sends to ``rank``, in order."""
    staged = [staged_pieces(t, s) for s, t in enumerate(all_tables)]
    stage_off = [staging_offsets(t.input_split_sizes, staged[s]) for s, t in enumerate(all_tables)]
    stage_counts = [sum(t.input_split_sizes[i] for i in staged[s]) for s, t in enumerate(all_tables)]
    sent_to_me = [t.sends()[rank] for t in all_tables]
    return staged, stage_off, stage_counts, sent_to_me


def cast_layout(all_tables: Sequence[CastTables], rank: int) -> NativeCastLayout:
    """Native GroupCast tables of ``rank`` from every rank's (consistent) tables."""
    me = all_tables[rank]
    staged, stage_off, stage_counts, sent_to_me = _staging(all_tables, rank, cast_staged_pieces)
    # matching rule: the k-th piece s sends to me is my k-th output piece from s
    pos = [0] * len(all_tables)
    in_off = offsets(me.input_split_sizes)
    starts, sizes, ranks = [], [], []
    for j, s in enumerate(me.src_index):
        i = sent_to_me[s][pos[s]]
        pos[s] += 1
        starts.append(in_off[i] if s == rank else stage_off[s][i])
        sizes.append(me.output_split_sizes[j])
        ranks.append(s)
    size_t = torch.tensor(sizes, dtype=torch.int64)
    return NativeCastLayout(
        stage_rows=_stage_rows(me.input_split_sizes, staged[rank]),
        src_rank=torch.repeat_interleave(torch.tensor(ranks, dtype=torch.int32), size_t),
        src_row=_rows(starts, sizes),
        max_stage_rows=max(stage_counts, default=0),
        remote=any(n > 0 for n in stage_counts),
    )


def reduce_layout(all_tables: Sequence[ReduceTables], rank: int) -> NativeReduceLayout:
    """Native GroupReduce tables of ``rank``: for every output row, its contributions ordered by source rank
    (the order in which the all-to-all-v path reduces them, so both give the same sums)."""
    me = all_tables[rank]
    staged, stage_off, stage_counts, sent_to_me = _staging(all_tables, rank, reduce_staged_pieces)
    pos = [0] * len(all_tables)
    in_off = offsets(me.input_split_sizes)
    out_off = offsets(me.output_split_sizes)
    touched, counts, c_src, c_row, weights = [], [], [], [], []
    # the k-th piece s sends to me is my k-th output piece listing s (pieces in order, so pos[s] advances
    # in output-piece order for every source)
    for j, srcs in enumerate(me.src_indices):
        n = me.output_split_sizes[j]
        ordered = sorted(srcs)
        first_rows = []
        for s in ordered:
            i = sent_to_me[s][pos[s]]
            pos[s] += 1
            first_rows.append(in_off[i] if s == rank else stage_off[s][i])
        if n == 0 or not ordered:
            continue
        m = len(ordered)
        t = torch.arange(n, dtype=torch.int64)
        touched.append(out_off[j] + t)
        counts.append(torch.full((n,), m, dtype=torch.int64))
        # row-major [n, m]: row t's contributions, sources increasing
        c_src.append(torch.tensor(ordered, dtype=torch.int32).repeat(n))
        c_row.append((t[:, None] + torch.tensor(first_rows, dtype=torch.int64)[None, :]).reshape(-1))
        weights.append(torch.full((n,), 1.0 / m, dtype=torch.float32))

    def cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)

    cnt = cat(counts, torch.int64)
    ptr = torch.zeros(cnt.numel() + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(cnt, 0)
    return NativeReduceLayout(
        stage_rows=_stage_rows(me.input_split_sizes, staged[rank]),
        touched=cat(touched, torch.int64),
        ptr=ptr,
        c_src=cat(c_src, torch.int32),
        c_row=cat(c_row, torch.int64),
        avg_weight=cat(weights, torch.float32),
        max_stage_rows=max(stage_counts, default=0),
        remote=any(n > 0 for n in stage_counts),
    )


# --------------------------------------------------------------------------------------------------
# Layout of one collective call inside a rank's symmetric buffer (identical on every rank).

#: Every region starts at a multiple of this many bytes (peer address differences are kept in these units,
#: so kernels get 256-byte-aligned row bases; cudaMalloc returns at least 256-byte-aligned pointers).
UNIT_BYTES = 256


def align_up(n: int, a: int = UNIT_BYTES) -> int:
    return -(-n // a) * a


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Byte sizes of one call's staging area (data rows, then the lse rows of ``reduce_op="lse"``)."""

    data_bytes: int
    lse_offset: int
    total: int

    @staticmethod
    def of(max_stage_rows: int, row_bytes: int, lse_row_bytes: int = 0) -> SlotLayout:
        data = align_up(max_stage_rows * row_bytes)
        lse = align_up(max_stage_rows * lse_row_bytes)
        return SlotLayout(data_bytes=data, lse_offset=data, total=data + lse)
