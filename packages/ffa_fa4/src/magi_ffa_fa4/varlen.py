"""Masks FlashAttention-4 runs natively: slices grouped into FA4 varlen calls, one batch entry per slice.

FA4's own varlen kernels (``cu_seqlens`` offsets, ``seqused`` lengths, ``causal`` / ``window_size``) know
where every document starts, so no tile is masked element by element unless it holds a diagonal; the
block-sparse path (``_launch_meta``) treats a document start inside a 128-row tile as a Partial tile and
masks it with the interval mask_mod, which costs most in the backward. A mask whose slices all have a shape
FA4 expresses with one window per call is therefore split into a few *groups*; each group is one varlen
call whose entries are its slices:

- entry ``b``: query rows ``[q_start, q_end)`` and keys ``[k_start, k_end)``; FA4 aligns its window to the
  entry's bottom-right corner: local row ``i`` sees local keys ``j`` with
  ``i + lk - lq - left <= j <= i + lk - lq + right`` (``None`` = unbounded);
- a slice's exact constraint from its diagonals (``magi_ffa``'s ``Slice.dk`` / ``dk_inv``): the causal part
  fixes ``right = dk - (k_end - q_end)`` (0 for CAUSAL and BI_CAUSAL), the inverse-causal part fixes
  ``left = (k_end - q_end) - dk_inv``; a side without a diagonal accepts any window that cuts nothing
  (``right >= lq - 1``, ``left >= lk - 1``) or none;
- within a group the entries' query ranges are disjoint and ascending (each output row is written once)
  and so are their key ranges (each dK / dV row is written once); all entries accept the group's window;
- slices stacked on consecutive query rows whose union is exactly one window of their bounding box (a
  sliding window arrives as a CAUSAL head and a BI_CAUSAL band, ``magi_attention.helpers`` decomposes
  windows so) become ONE entry with that window: FA4's own windowed kernel then runs the whole band, as
  ``window_size`` does, instead of one group per piece.

Greedy in query order; a mask needing more than ``MAX_GROUPS`` groups, or with tiny entries (mean query
length under ``MIN_MEAN_ROWS``, where per-entry tile padding would cost more than the masking saves), keeps
the block-sparse path. ``MAX_GROUPS`` is 1 by measurement (H200, 2026-12-01): one group (packed documents,
causal or full) runs at FA4's own speed, 0.96-1.02x of ``flash_attn_varlen_func`` in the backward against
0.62-0.77x on the block-sparse path; with two groups the extra launches, pre-filled buffers and the sum of
dK / dV over groups cost more than the masking they save (sliding window 2048 at 32k: backward 280 against
317 TFLOP/s block-sparse; one simulated cp-8 rank of varlen causal: forward 3.34 against 1.87 ms). The
launchers handle any number of groups (``max_groups``), tested on the CPU and on the H200.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from magi_ffa._slice import Slice

__all__ = [
    "MAX_GROUPS",
    "MIN_MEAN_ROWS",
    "SEQLEN_FLOOR",
    "VarlenGroup",
    "VarlenPlan",
    "plan_varlen",
    "varlen_possible",
]

MAX_GROUPS = 1
MIN_MEAN_ROWS = 256
SEQLEN_FLOOR = 512
"""Smallest ``max_seqlen_q`` / ``max_seqlen_k`` handed to FA4. FA4 reads them as upper bounds (grid size),
and its compile keys hold whether they fit one tile (``seqlen <= tile``, up to 2 x 128 rows): a floor above
every tile keeps those flags fixed, so a group of short entries compiles no kernel of its own. Entries
shorter than it cost a few empty programs that exit at once."""

_Bound = tuple[int, int | None]  # accepted window values [lo, hi], hi None = unbounded


def _meet(a: _Bound, b: _Bound) -> _Bound | None:
    lo = max(a[0], b[0])
    hi = a[1] if b[1] is None else b[1] if a[1] is None else min(a[1], b[1])
    return None if hi is not None and lo > hi else (lo, hi)


@dataclass(frozen=True, slots=True)
class _Entry:
    """One FA4 batch entry: its rows and keys and the (left, right) window values it accepts."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    left: _Bound
    right: _Bound


def _slice_entry(s: Slice) -> _Entry:
    """A slice as one entry: the window values that reproduce it (see the module docstring)."""
    lq, lk = s.q_end - s.q_start, s.k_end - s.k_start
    corner = s.k_end - s.q_end  # FA4's bottom-right diagonal, in global key - row
    right = (s.dk - corner, s.dk - corner) if s.is_causal else (lq - 1, None)
    left = (corner - s.dk_inv, corner - s.dk_inv) if s.is_inv_causal else (lk - 1, None)
    return _Entry(s.q_start, s.q_end, s.k_start, s.k_end, left, right)


def _side(need: np.ndarray, cut: np.ndarray) -> _Bound | None:
    """Window values of one side: rows where the window cuts (``cut``) fix it to their ``need``, which must
    be one value; the other rows need at least theirs. None when no non-negative value fits."""
    floor = int(need[~cut].max()) if (~cut).any() else 0
    if not cut.any():
        return (max(floor, 0), None)
    exact = need[cut]
    value = int(exact[0])
    if value < 0 or value < floor or (exact != value).any():
        return None
    return (value, value)


def _window_entry(run: Sequence[Slice]) -> _Entry | None:
    """The one entry whose window is exactly the union of ``run`` (slices on consecutive query rows), or
    None: per row the slices' key intervals must join into one non-empty interval, and those intervals must be
    a window of their bounding box, aligned at its bottom-right corner as FA4 aligns it."""
    qa, qb = run[0].q_start, run[-1].q_end
    rows = np.arange(qa, qb, dtype=np.int64)
    lo = np.full(rows.size, np.iinfo(np.int64).max)
    hi = np.full(rows.size, np.iinfo(np.int64).min)
    length = np.zeros(rows.size, dtype=np.int64)
    for s in run:
        r = rows[s.q_start - qa : s.q_end - qa]
        s_lo = np.maximum(s.k_start, r + s.dk_inv) if s.is_inv_causal else np.full(r.size, s.k_start)
        s_hi = np.minimum(s.k_end, r + s.dk + 1) if s.is_causal else np.full(r.size, s.k_end)
        sel = slice(s.q_start - qa, s.q_end - qa)
        lo[sel] = np.minimum(lo[sel], s_lo)
        hi[sel] = np.maximum(hi[sel], s_hi)
        length[sel] += np.maximum(s_hi - s_lo, 0)
    if (length <= 0).any() or (hi - lo != length).any():  # an empty row, or a row of two intervals
        return None
    ka, kb = int(lo.min()), int(hi.max())
    corner = kb - qb
    left = _side(rows + corner - lo, lo > ka)
    right = _side(hi - 1 - rows - corner, hi < kb)
    return None if left is None or right is None else _Entry(qa, qb, ka, kb, left, right)


def _row_keys(s: Slice, r: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` of slice ``s`` at global row ``r`` (empty when ``lo >= hi``)."""
    lo = max(s.k_start, r + s.dk_inv) if s.is_inv_causal else s.k_start
    hi = min(s.k_end, r + s.dk + 1) if s.is_causal else s.k_end
    return lo, hi


def _may_join(last: Slice, s: Slice) -> bool:
    """A necessary condition for :func:`_window_entry` to join ``s`` to a run ending with ``last``, read from
    the two rows at the seam alone (``s`` starts on the row after ``last``, and each row of a run belongs
    to one of its slices): a window clipped to its bounding box has ``lo = max(ka, r + corner - left)`` and
    ``hi = min(kb, r + corner + right + 1)``, so from one row to the next each bound stays or grows by 1.
    Packed documents fail it at every seam (the keys jump to the next document), which spares the per-row
    numpy pass of :func:`_window_entry` for each of their slices."""
    lo0, hi0 = _row_keys(last, s.q_start - 1)
    lo1, hi1 = _row_keys(s, s.q_start)
    return 0 <= lo1 - lo0 <= 1 and 0 <= hi1 - hi0 <= 1


def _entries(slices: Sequence[Slice], max_entries: int | None = None) -> list[_Entry] | None:
    """The slices as entries, those on consecutive rows joined while their union stays one window; None as
    soon as there are more than ``max_entries`` (joins only replace the last entry, so the count never
    falls)."""
    out: list[_Entry] = []
    run: list[Slice] = []
    for s in sorted(slices, key=lambda x: (x.q_start, x.k_start)):
        joined = (
            _window_entry([*run, s]) if run and s.q_start == run[-1].q_end and _may_join(run[-1], s) else None
        )
        if joined is not None:
            run.append(s)
            out[-1] = joined
        else:
            run = [s]
            out.append(_slice_entry(s))
            if max_entries is not None and len(out) > max_entries:
                return None
    return out


@dataclass(frozen=True, slots=True)
class VarlenGroup:
    """One FA4 varlen call: entries (slices) with disjoint, ascending query and key ranges, one window.

    ``window_left`` / ``window_right``: FA4's window (``None`` = unbounded; ``(None, 0)`` is causal).
    The tensors are int32 on the device: ``cu_seqlens_q`` / ``cu_seqlens_k`` ``[n + 1]`` (entry starts, then
    the last end), ``seqused_q`` / ``seqused_k`` ``[n]`` entry lengths, or None when the entries are
    contiguous (the lengths are then the differences of ``cu_seqlens``); ``lengths_q`` / ``lengths_k``
    ``[n]`` the entry lengths always (what the launches pass as ``seqused``, see :meth:`fa4_kwargs`).
    """

    q_ranges: tuple[tuple[int, int], ...]
    k_ranges: tuple[tuple[int, int], ...]
    window_left: int | None
    window_right: int | None
    cu_seqlens_q: torch.Tensor = field(repr=False)
    cu_seqlens_k: torch.Tensor = field(repr=False)
    seqused_q: torch.Tensor | None = field(repr=False)
    seqused_k: torch.Tensor | None = field(repr=False)
    max_seqlen_q: int
    max_seqlen_k: int
    covers_q: bool
    """Its entries hold every query row (else the rows of no entry are left unwritten by FA4)."""
    covers_k: bool
    """Its entries hold every key (else FA4 leaves the dK / dV rows of the other keys unwritten)."""
    lengths_q: torch.Tensor = field(repr=False)
    lengths_k: torch.Tensor = field(repr=False)

    def fa4_kwargs(self) -> dict:
        """The keyword arguments of ``_flash_attn_fwd`` / ``_flash_attn_bwd`` for this group.

        Both ``seqused`` are always given (the entry lengths, equal to the ``cu_seqlens`` differences when
        the entries are contiguous) and the ``max_seqlen`` are at least :data:`SEQLEN_FLOOR`: FA4's compile
        keys hold whether ``seqused`` is None and whether a sequence fits one tile, so otherwise two masks
        of one shape could need two compiled kernels (see :func:`magi_ffa_fa4.compile_key`)."""
        causal = self.window_left is None and self.window_right == 0
        return dict(
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            seqused_q=self.lengths_q,
            seqused_k=self.lengths_k,
            max_seqlen_q=max(self.max_seqlen_q, SEQLEN_FLOOR),
            max_seqlen_k=max(self.max_seqlen_k, SEQLEN_FLOOR),
            causal=causal,
            window_size_left=None if causal else self.window_left,
            window_size_right=None if causal else self.window_right,
        )


@dataclass(frozen=True, slots=True)
class VarlenPlan:
    """The groups of a mask, and what the launchers must add around them.

    ``q_disjoint``: no query row is in two groups (the forward writes one output, no merge).
    ``q_covered`` / ``k_covered``: every query row / key is in some entry (else rows with no key get out 0
    and lse -inf, and uncovered dQ / dK / dV rows 0, by pre-filled buffers).
    """

    groups: tuple[VarlenGroup, ...]
    q_disjoint: bool
    q_covered: bool
    k_covered: bool


@dataclass
class _Open:
    left: _Bound
    right: _Bound
    entries: list[_Entry]


def _group(entries: Sequence[_Entry], max_groups: int) -> list[_Open] | None:
    groups: list[_Open] = []
    for e in entries:  # in (q_start, k_start) order
        for g in groups:
            last = g.entries[-1]
            if e.q_start < last.q_end or e.k_start < last.k_end:
                continue
            nl, nr = _meet(g.left, e.left), _meet(g.right, e.right)
            if nl is not None and nr is not None:
                g.left, g.right = nl, nr
                g.entries.append(e)
                break
        else:
            if len(groups) == max_groups:
                return None
            groups.append(_Open(e.left, e.right, [e]))
    return groups


def _union_len(ranges: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for a, b in sorted(ranges):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _tensors(
    ranges: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``cu_seqlens``, ``seqused`` (None when the ranges are contiguous) and the lengths, on ``device``."""
    starts = [a for a, _ in ranges]
    cu = torch.tensor([*starts, ranges[-1][1]], dtype=torch.int32)
    contiguous = all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    lengths = torch.tensor([b - a for a, b in ranges], dtype=torch.int32).to(device)
    return cu.to(device), None if contiguous else lengths, lengths


def _open_groups(slices: Sequence[Slice], max_groups: int, min_mean_rows: int) -> list[_Open] | None:
    if not slices:
        return None
    # an entry's rows are those of its slices (a join takes slices on consecutive rows), so the entries hold
    # as many rows as the slices and the mean-length rule caps how many entries may be built
    rows = sum(s.q_end - s.q_start for s in slices)
    entries = _entries(slices, rows // min_mean_rows if min_mean_rows > 0 else None)
    if entries is None or rows < min_mean_rows * len(entries):
        return None
    return _group(entries, max_groups)


def varlen_possible(
    slices: Sequence[Slice], *, max_groups: int = MAX_GROUPS, min_mean_rows: int = MIN_MEAN_ROWS
) -> bool:
    """Whether :func:`plan_varlen` would return groups for these slices (host work only, no tensors)."""
    return _open_groups(slices, max_groups, min_mean_rows) is not None


def plan_varlen(
    slices: Sequence[Slice],
    total_q: int,
    total_k: int,
    device: torch.device,
    *,
    max_groups: int = MAX_GROUPS,
    min_mean_rows: int = MIN_MEAN_ROWS,
) -> VarlenPlan | None:
    """The varlen groups of these disjoint-area slices (``magi_ffa.validation.host_slices``), or None when
    the mask is better served by the block-sparse path (see the module docstring)."""
    opened = _open_groups(slices, max_groups, min_mean_rows)
    if opened is None:
        return None
    groups = []
    for g in opened:
        qr = [(e.q_start, e.q_end) for e in g.entries]
        kr = [(e.k_start, e.k_end) for e in g.entries]
        cu_q, used_q, len_q = _tensors(qr, device)
        cu_k, used_k, len_k = _tensors(kr, device)
        groups.append(
            VarlenGroup(
                q_ranges=tuple(qr), k_ranges=tuple(kr),
                window_left=None if g.left[1] is None else g.left[0],
                window_right=None if g.right[1] is None else g.right[0],
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k,
                max_seqlen_q=max(b - a for a, b in qr), max_seqlen_k=max(b - a for a, b in kr),
                covers_q=sum(b - a for a, b in qr) == total_q, covers_k=sum(b - a for a, b in kr) == total_k,
                lengths_q=len_q, lengths_k=len_k,
            )
        )  # fmt: skip
    all_q = [r for g in groups for r in g.q_ranges]
    all_k = [r for g in groups for r in g.k_ranges]
    q_union = _union_len(all_q)
    return VarlenPlan(
        groups=tuple(groups),
        q_disjoint=q_union == sum(b - a for a, b in all_q),
        q_covered=q_union == total_q,
        k_covered=_union_len(all_k) == total_k,
    )
