"""FlexAttention `mask_mod` functions to exact slice masks.

A `mask_mod(b, h, q_idx, kv_idx) -> bool` says whether query `q_idx` sees key `kv_idx`. Exactness for an
arbitrary function needs every element evaluated (as FlexAttention's `create_block_mask` does), so the mask is
evaluated tile by tile (a band of rows across all keys; never the whole mask at once), vectorised on the given
device. Each row becomes its sorted, disjoint key intervals; consecutive rows whose intervals move in lockstep
(each end fixed or advancing one key per row) are folded into one slice:

| interval start per row | interval end per row | slice |
|---|---|---|
| fixed | fixed | FULL |
| fixed | +1 | CAUSAL (bottom-right aligned) |
| +1 | fixed | INV_CAUSAL (top-left aligned) |
| +1 | +1 | BI_CAUSAL (a band) |

So a document-causal mask gives one CAUSAL slice per document, a causal sliding window a CAUSAL head and a
BI_CAUSAL band per document, a prefix-LM mask a FULL and a CAUSAL slice per document; only rows with no
such structure cost one slice each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from magi_solver import AttnMaskType, AttnRanges

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_TILE_ELEMENTS = 1 << 24
"""Mask elements evaluated at once (a band of rows across all keys): ~16 M bools per tile."""

_TYPE_OF_SLOPES = {
    (0, 0): AttnMaskType.FULL,
    (0, 1): AttnMaskType.CAUSAL,
    (1, 0): AttnMaskType.INV_CAUSAL,
    (1, 1): AttnMaskType.BI_CAUSAL,
}


@dataclass(slots=True)
class _Run:
    """Rows ``first_row..last_row`` whose interval moves with constant slopes (None while it has one row)."""

    first_row: int
    last_row: int
    start0: int
    end0: int
    last_start: int
    last_end: int
    slopes: tuple[int, int] | None = None

    def step(self, start: int, end: int) -> tuple[int, int] | None:
        """The slopes that taking ``(start, end)`` as the next row would give, or None if it cannot."""
        step = (start - self.last_start, end - self.last_end)
        if step not in _TYPE_OF_SLOPES or (self.slopes is not None and step != self.slopes):
            return None
        return step

    def take(self, row: int, start: int, end: int, slopes: tuple[int, int]) -> None:
        self.last_row, self.last_start, self.last_end, self.slopes = row, start, end, slopes

    def to_slice(self) -> tuple[tuple[int, int], tuple[int, int], AttnMaskType]:
        slopes = self.slopes or (0, 0)
        # FULL / INV_CAUSAL keep the first row's end; CAUSAL / BI_CAUSAL end at the last row's end. Row i of a
        # CAUSAL slice then sees keys below end0 + i (bottom-right diagonal), a BI_CAUSAL one also from start0 + i.
        k_end = self.last_end if slopes[1] else self.end0
        return (self.first_row, self.last_row + 1), (self.start0, k_end), _TYPE_OF_SLOPES[slopes]


class _RowFolder:
    """Folds rows of sorted disjoint key intervals into slices, one row after the other."""

    def __init__(self) -> None:
        self.active: list[_Run] = []
        self.slices: list[tuple[tuple[int, int], tuple[int, int], AttnMaskType]] = []

    def add_row(self, row: int, intervals: list[tuple[int, int]]) -> None:
        if self.active and len(intervals) == len(self.active) and self.active[0].last_row == row - 1:
            steps = [run.step(s, e) for run, (s, e) in zip(self.active, intervals)]
            if all(st is not None for st in steps):
                for run, (s, e), st in zip(self.active, intervals, steps):
                    run.take(row, s, e, st)
                return
        self.flush()
        self.active = [_Run(row, row, s, e, s, e) for s, e in intervals]

    def flush(self) -> None:
        self.slices.extend(run.to_slice() for run in self.active)
        self.active = []


def _row_intervals(tile: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of a bool ``[rows, keys]`` tile: its visible keys as sorted disjoint ``(start, end)`` pairs."""
    padded = torch.nn.functional.pad(tile, (1, 1))
    # every change along a row is a start or one-past-the-end of a run of visible keys; in row-major order
    # they alternate start, end within each row
    rows, cols = (padded[:, 1:] != padded[:, :-1]).nonzero(as_tuple=True)
    rows, starts, ends = rows[0::2], cols[0::2], cols[1::2]
    counts = torch.bincount(rows, minlength=tile.shape[0]).tolist()
    pairs = list(zip(starts.tolist(), ends.tolist()))
    out, at = [], 0
    for n in counts:
        out.append(pairs[at : at + n])
        at += n
    return out


def _check_positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def _evaluate(mask_mod: MaskMod, b: int, h: int, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    dev = q_idx.device
    out = mask_mod(torch.tensor(b, device=dev), torch.tensor(h, device=dev), q_idx, kv_idx)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"`mask_mod` must return a bool tensor, got {type(out).__name__}")
    if out.dtype != torch.bool:
        raise TypeError(f"`mask_mod` must return a bool tensor, got dtype {out.dtype}")
    try:
        return torch.broadcast_to(out, (q_idx.shape[0], kv_idx.shape[1]))
    except RuntimeError:
        raise ValueError(
            f"`mask_mod` returned shape {tuple(out.shape)} for q_idx {tuple(q_idx.shape)} and kv_idx "
            f"{tuple(kv_idx.shape)}: it must broadcast elementwise over q_idx and kv_idx"
        ) from None


def infer_attn_mask_from_mask_mod(
    mask_mod: MaskMod,
    total_seqlen_q: int,
    total_seqlen_k: int,
    *,
    device: torch.device | str | None = None,
) -> tuple[AttnRanges, AttnRanges, list[AttnMaskType]]:
    """The exact slice form of a FlexAttention ``mask_mod``.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` as FlexAttention defines it; called with
            0-d ``b`` / ``h`` and int64 ``q_idx`` ``[rows, 1]``, ``kv_idx`` ``[1, keys]`` on ``device``, so it
            must be elementwise (broadcasting), as FlexAttention's own ``create_mask`` requires.
        total_seqlen_q: number of query rows.
        total_seqlen_k: number of keys.
        device: where the mask is evaluated (the GPU when given; default the CPU). The mask is evaluated in
            bands of rows (about 16 M elements at a time), never whole.

    Returns:
        ``(q_ranges, k_ranges, attn_mask_types)``: slices whose union equals the mask element for element
        (rows that see no key are in no slice). Compact where the mask has structure (see module docstring).

    Raises:
        ValueError: a mask that depends on the batch or head index (every tile is evaluated at b, h = 0, 0
            and 1, 1, the first also at 1, 0), or bad sizes. TypeError: a non-callable or a non-bool result.
    """
    if not callable(mask_mod):
        raise TypeError(f"`mask_mod` must be callable, got {type(mask_mod).__name__}")
    tq = _check_positive(total_seqlen_q, "total_seqlen_q")
    tk = _check_positive(total_seqlen_k, "total_seqlen_k")
    dev = torch.device("cpu" if device is None else device)
    kv_idx = torch.arange(tk, device=dev)[None, :]
    rows_per_tile = max(1, _TILE_ELEMENTS // tk)
    folder = _RowFolder()
    for r0 in range(0, tq, rows_per_tile):
        q_idx = torch.arange(r0, min(tq, r0 + rows_per_tile), device=dev)[:, None]
        tile = _evaluate(mask_mod, 0, 0, q_idx, kv_idx)
        # (1, 1) on every tile catches a mask that follows b or h; (1, 0) on the first tile one that follows
        # only their combination
        for b, h in ((1, 1), (1, 0)) if r0 == 0 else ((1, 1),):
            if not torch.equal(tile, _evaluate(mask_mod, b, h, q_idx, kv_idx)):
                raise ValueError(
                    "`mask_mod` depends on the batch or head index (rows "
                    f"{r0}..{r0 + q_idx.shape[0] - 1} differ between b, h = 0, 0 and {b}, {h}); a slice mask is "
                    "the same for every batch element and head"
                )
        for i, intervals in enumerate(_row_intervals(tile)):
            if intervals:
                folder.add_row(r0 + i, intervals)
            else:
                folder.flush()
    folder.flush()
    q = AttnRanges.from_ranges([qr for qr, _, _ in folder.slices])
    k = AttnRanges.from_ranges([kr for _, kr, _ in folder.slices])
    return q, k, [t for _, _, t in folder.slices]
