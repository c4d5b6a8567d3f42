"""Which attention kernel is fastest for a mask: features every rank computes alike, and a measured table.

The runtime's ``kernel_backend="auto"`` asks this module once per key (:func:`advise_kernel`, about every
rank's problem after dispatch, :class:`RankProblems`). The features describe the problem the
busiest rank's kernel computes after dispatch: the rank's query rows against its keys in the kernel's order,
the rank's own keys first, then the keys it receives from other ranks (the runtime concatenates its local
K/V and the received K/V, for the merged call and for each overlap stage alike). They come from the global
mask and the dispatch alone, so every rank computes the same numbers with no communication:

- ``tokens``: the rank's query rows;
- ``tile_fill``: the mask's area over the area of the 128 x 128 tiles it touches (1 for a full mask; lower
  when document starts and diagonals cut tiles, which is where the kernels differ most);
- ``slices_per_row``: how many slices a covered row belongs to on average (1 for packed documents; more for
  fragmented masks, and for documents cut by a rank boundary);
- ``documents``: the slices have disjoint, ascending query ranges and disjoint, ascending key ranges in the
  same order, all of one type, FULL or CAUSAL (packed documents; one slice is one document): a mask a kernel
  can run as independent sequences (FA4's varlen kernels do).

Why the kernel's key order and not the global one: packed documents that cross rank boundaries are not
packed documents for the kernel. A rank's rows of a cut causal document see the received part of the
document in full and its own part causally: two slices per row, whose key ranges no longer ascend with the
rows, which FA4 runs through its block-sparse path (a slow backward). Simulated cp 8, 8192 tokens per GPU,
64:8 heads, d 128, one H200 (2026-12-02; torch 2.11.0+cu130, flash-attn-4 4.0.0b36, nvidia-cudnn-frontend
1.32.0), slowest rank forward / backward ms: packed causal documents cuDNN 2.06 / 6.78, FA4 2.28 / 9.20;
packed full documents cuDNN 3.58 / 12.26, FA4 3.76 / 15.14. In global key coordinates the busiest rank's
problem would look like packed documents, whose rows FA4 wins; in the kernel's it is fragmented, and the nearest
rows are cuDNN's. A full mask stays one slice per row (FULL pieces that touch again in the kernel's order
merge), so it keeps the full rows (cp 8: cuDNN 28.7 / 78.2, FA4 30.0 / 77.3, a tie).

The received keys are ordered by global id here, a simplification that needs no overlap plan: the runtime's
receive buffers order them by sending rank (and split them into stages at overlap degree >= 1), which cuts
the packed causal documents above further (2.1 slices per row at overlap degree 0 against 1.33 here); both
are far from packed documents. At cp 1 the rank holds every key in global order: the features are the
global mask's, the problem the table measured.

A table measured on one GPU kind (``benchmarks/kernel_backends_bench.py --write-table``; shipped as package
data, ``kernel_tables/<gpu kind>.json``) holds, per measured mask and size, each backend's forward and backward
milliseconds and the mask's features. :func:`pick_kernel` takes the nearest measured row of the same head_dim
and returns the backend with the smallest forward + backward time among the candidates (the backward's 2.5x
FLOPs are in its time) for both directions, unless another candidate is faster by more than
:data:`SPLIT_GAIN` in one direction: then that direction runs on it. Every backend keeps the same contract
(the backward starts from the final out / lse, whichever kernel made them), so a forward on one backend and a
backward on another compute the same attention. No timing at run time: same inputs, same answer on every
rank.

Deterministic mode (``DistAttnConfig.deterministic``) asks each backend for a bitwise repeatable backward,
which costs time (ordered accumulation instead of atomics). A row measured that way carries
``"deterministic": true``; ``pick_kernel(..., deterministic=True)`` uses only those rows, and falls back to
the default-mode rows (its reason says so) when the table has none for the head_dim. The caller restricts
the candidates to the backends that can run deterministically on every rank's problem.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np
from magi_mask import normalize_types

from ._slicing import merge_full
from .kv_layout import KVLayout
from .mask import AttnSlice, SliceList

__all__ = [
    "SAME_ARCHITECTURE",
    "SPLIT_GAIN",
    "TILE",
    "KernelAdvice",
    "KernelPick",
    "KernelTable",
    "MaskFeatures",
    "RankProblems",
    "advise_kernel",
    "busiest_rank_features",
    "kernel_key_ids",
    "load_kernel_table",
    "mask_features",
    "pick_kernel",
]

TILE = 128
"""Tile edge of the features (the forward tile of the FA4 and cuDNN kernels on Hopper)."""

SPLIT_GAIN = 0.05
"""A direction leaves the backend of the fastest forward + backward only for one measured faster by more than
this share of that direction's time (a second backend costs its own plans and compiles)."""


@dataclass(frozen=True, slots=True)
class MaskFeatures:
    """The features of one rank's attention problem (see the module docstring)."""

    tokens: int
    area: int
    tile_fill: float
    slices_per_row: float
    documents: bool

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "area": self.area,
            "tile_fill": round(self.tile_fill, 4),
            "slices_per_row": round(self.slices_per_row, 4),
            "documents": self.documents,
        }


def _documents(raw: list[tuple[int, int, int, int, int]]) -> bool:
    if not raw or len({t for *_, t in raw}) != 1 or raw[0][4] not in (0, 1):
        return False
    ordered = sorted(raw)
    return all(a[1] <= b[0] and a[3] <= b[2] for a, b in itertools.pairwise(ordered))


def _row_bounds(qs: int, qe: int, ks: int, ke: int, t: int, a: int, b: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that rows ``[a, b)`` of slice ``(qs, qe, ks, ke, t)`` see, together (magi's shapes:
    CAUSAL bottom-right aligned, INV_CAUSAL top-left aligned)."""
    lo = ks + (a - qs) if t & 2 else ks
    hi = ke - (qe - b) if t & 1 else ke
    return max(lo, ks), min(hi, ke)


def _tiles(sl: np.ndarray) -> int:
    """128 x 128 tiles the slices ``[n, 5]`` touch (a tile two slices share counts once): per 128-row block
    of each slice, the key tiles its rows see (`_row_bounds`, vectorised), merged per block."""
    if sl.shape[0] == 0:
        return 0
    qs, qe, ks, ke, t = sl.T
    first, last = qs // TILE, (qe - 1) // TILE
    count = last - first + 1
    idx = np.repeat(np.arange(sl.shape[0]), count)
    m = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count) + first[idx]
    a = np.maximum(qs[idx], m * TILE)
    b = np.minimum(qe[idx], (m + 1) * TILE)
    lo = np.where(t[idx] & 2, ks[idx] + (a - qs[idx]), ks[idx])
    hi = np.where(t[idx] & 1, ke[idx] - (qe[idx] - b), ke[idx])
    lo, hi = np.maximum(lo, ks[idx]), np.minimum(hi, ke[idx])
    ok = lo < hi
    m, lo, hi = m[ok], lo[ok] // TILE, -(-hi[ok] // TILE)
    if m.size == 0:
        return 0
    span = int(hi.max()) + 1  # blocks' tile coordinates never overlap after this shift
    lo, hi = lo + m * span, hi + m * span
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    gaps = np.maximum(lo[1:] - reach[:-1], 0).sum()
    # the shifted intervals' union: from the first start to the last reach, less the gaps (between blocks
    # too, which the shift makes gaps)
    return int(reach[-1] - lo[0] - gaps)


def mask_features(slices: Iterable[AttnSlice | tuple], total_q: int) -> MaskFeatures:
    """Features of the mask made of ``slices`` over ``total_q`` query rows (slices as ``AttnSlice`` or
    ``(q_start, q_end, k_start, k_end, type)``; overlapping slices count their shared area twice)."""
    raw = [
        (s.q_range.start, s.q_range.end, s.k_range.start, s.k_range.end, s.mask_type.code)
        if isinstance(s, AttnSlice)
        else tuple(int(x) for x in s)
        for s in slices
    ]
    area, rows_in_slices = 0, 0
    covered = np.zeros(max(total_q, 1), dtype=bool)
    kept = []
    for qs, qe, ks, ke, t in raw:
        if qe <= qs or ke <= ks:
            continue
        a = AttnSlice((qs, qe), (ks, ke), t).area()
        if a == 0:
            continue
        area += a
        rows_in_slices += qe - qs
        covered[qs:qe] = True
        kept.append((qs, qe, ks, ke, t))
    tiles = _tiles(np.asarray(kept, dtype=np.int64).reshape(-1, 5))
    rows = int(covered[:total_q].sum())
    return MaskFeatures(
        tokens=total_q,
        area=area,
        tile_fill=area / (tiles * TILE * TILE) if tiles else 1.0,
        slices_per_row=rows_in_slices / rows if rows else 1.0,
        documents=_documents([r for r in raw if r[1] > r[0] and r[3] > r[2]]),
    )


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Sorted global row ids -> ``(global start, global end, local start)`` runs."""
    if rows.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [rows.size]])
    return [(int(rows[s]), int(rows[e - 1]) + 1, int(s)) for s, e in zip(starts, ends)]


def _key_pieces(
    ks: int, ke: int, key_runs: list[tuple[int, int, int]], run_starts: list[int], num_local: int
) -> list[tuple[int, int, int]]:
    """Global keys ``[ks, ke)`` as ``(global start, global end, kernel start)`` pieces in the kernel's key
    coordinates: a rank's own keys first (``key_runs``: its sorted key ids as :func:`_runs`), then every
    other key ordered by global id. A key ``g`` no run holds sits at ``num_local + g - (own keys < g)``."""
    pieces: list[tuple[int, int, int]] = []
    j = max(bisect.bisect_right(run_starts, ks) - 1, 0)
    cursor = ks
    own_before = 0  # own keys below `cursor`, while `cursor` is not an own key
    for g0, g1, l0 in key_runs[j:]:
        if g0 >= ke:
            break
        if g1 <= cursor:
            own_before = l0 + g1 - g0
            continue
        if cursor < g0:
            pieces.append((cursor, g0, num_local + cursor - own_before))
        a, b = max(g0, cursor), min(g1, ke)
        pieces.append((a, b, l0 + a - g0))
        cursor, own_before = b, l0 + b - g0
    if cursor < ke:
        pieces.append((cursor, ke, num_local + cursor - own_before))
    return pieces


def _in_kernel_keys(
    local: list[tuple[int, int, int, int, int]], keys: np.ndarray
) -> list[tuple[int, int, int, int, int]]:
    """A rank's slices (local query rows, global keys) with their keys moved to the kernel's key coordinates
    (``keys``: the global ids the rank holds, sorted, unique). A slice's keys split into runs the rank holds
    and runs other ranks hold, each a typed sub-slice; FULL pieces that touch again afterwards (the same rows
    on keys now adjacent) merge, so only real fragmentation counts."""
    key_runs = _runs(keys)
    run_starts = [g0 for g0, _, _ in key_runs]
    moved: list[tuple[int, int, int, int, int]] = []
    for qs, qe, ks, ke, t in local:
        whole = AttnSlice((qs, qe), (ks, ke), t)
        for g0, g1, kernel_start in _key_pieces(ks, ke, key_runs, run_starts, int(keys.size)):
            parts = [whole] if (g0, g1) == (ks, ke) else whole.clip_k(g0, g1)
            shift = kernel_start - g0
            moved.extend((p.q_range.start, p.q_range.end, p.k_range.start + shift, p.k_range.end + shift,
                          p.mask_type.code) for p in parts)  # fmt: skip
    return merge_full(moved)


def kernel_key_ids(rank_rows: Sequence[np.ndarray], kv_layout: KVLayout | None) -> list[np.ndarray] | None:
    """Per rank, the global key ids its kernel holds as its own (the ``rank_keys`` of
    :func:`busiest_rank_features`): its query tokens in self-attention (``kv_layout`` None), its contiguous
    key/value shard in cross-attention; None for one rank, which holds every key in global order."""
    if len(rank_rows) <= 1:
        return None
    if kv_layout is None:
        return list(rank_rows)
    return [np.arange(*kv_layout.host_pairs(r)[0], dtype=np.int64) for r in range(len(rank_rows))]


def busiest_rank_features(
    q_ranges: Sequence[Sequence[int]],
    k_ranges: Sequence[Sequence[int]],
    types: Sequence[int] | str,
    rank_rows: Sequence[np.ndarray],
    *,
    rank_keys: Sequence[np.ndarray] | None = None,
) -> MaskFeatures:
    """Features of the busiest rank's problem: its query rows (global ids in ``rank_rows[r]``, in any order;
    padding ids past the mask are fine) against the keys. The busiest rank is the one with the largest area
    (ties: the lowest rank), so every rank picks the same one.

    Without ``rank_keys`` the keys keep their global ids (the problem of one rank that holds every key).
    With ``rank_keys`` (per rank, the global key ids it holds, in any order; padding ids are fine) the keys
    are as that rank's kernel sees them: its own keys first (sorted), then the keys other ranks send, ordered
    by global id. A document cut by a rank boundary then becomes two slices per row (remote keys and own
    keys), as the kernel runs it."""
    if rank_keys is not None and len(rank_keys) != len(rank_rows):
        raise ValueError(f"rank_keys has {len(rank_keys)} ranks, rank_rows {len(rank_rows)}")

    def pair(r) -> tuple[int, int]:  # (start, end) pairs or AttnRange objects
        return (int(r.start), int(r.end)) if hasattr(r, "start") else (int(r[0]), int(r[1]))

    q_pairs = tuple(map(pair, q_ranges))
    codes = tuple(normalize_types(types, len(q_pairs), "types"))  # ints, names or AttnMaskType members
    typed = list(SliceList(q_pairs, tuple(map(pair, k_ranges)), codes).typed_pairs())
    q_starts = np.asarray([q[0] for q, _, _ in typed], dtype=np.int64)
    q_ends = np.asarray([q[1] for q, _, _ in typed], dtype=np.int64)
    busiest_area, busiest_rank = -1, -1
    busiest_slices: list[tuple[int, int, int, int, int]] = []  # local rows, global keys
    busiest_rows = 0
    for rank, rows in enumerate(rank_rows):
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        local: list[tuple[int, int, int, int, int]] = []
        area = 0
        for g0, g1, l0 in _runs(rows):
            # a run meets few of the slices: find them at C speed
            for i in np.flatnonzero((q_starts < g1) & (q_ends > g0)).tolist():
                (qs, qe), (ks, ke), t = typed[i]
                for part in AttnSlice((qs, qe), (ks, ke), t).clip_q(g0, g1):
                    off = l0 - g0
                    area += part.area()
                    local.append((part.q_range.start + off, part.q_range.end + off, part.k_range.start,
                                  part.k_range.end, part.mask_type.code))  # fmt: skip
        if area > busiest_area:
            busiest_area, busiest_rank, busiest_slices, busiest_rows = area, rank, local, int(rows.size)
    if busiest_rank < 0:
        return MaskFeatures(0, 0, 1.0, 1.0, False)
    if rank_keys is not None:
        keys = np.unique(np.asarray(rank_keys[busiest_rank], dtype=np.int64))
        busiest_slices = _in_kernel_keys(busiest_slices, keys)
    return mask_features(busiest_slices, busiest_rows)


@dataclass(frozen=True, slots=True)
class KernelTable:
    """Measured rows of one GPU kind (see :func:`load_kernel_table` for the file)."""

    gpu_kind: str
    source: str
    rows: tuple[dict, ...]

    @classmethod
    def from_dict(cls, data: dict) -> KernelTable:
        """Rows need ``mask``, ``tokens``, ``head_dim``, ``tile_fill``, ``slices_per_row``, ``documents`` and
        ``ms`` (backend -> [forward ms, backward ms]); ``deterministic`` (bool, default false) marks a row
        measured in deterministic mode."""
        rows = []
        for i, row in enumerate(data["rows"]):
            missing = {"mask", "tokens", "head_dim", "tile_fill", "slices_per_row", "documents", "ms"} - set(
                row
            )
            if missing:
                raise ValueError(f"kernel table row {i} lacks {sorted(missing)}")
            det = row.get("deterministic", False)
            if not isinstance(det, bool):
                raise ValueError(f"kernel table row {i}: 'deterministic' must be a bool, got {det!r}")
            rows.append({**row, "deterministic": det})
        return cls(str(data["gpu_kind"]), str(data.get("source", "")), tuple(rows))


SAME_ARCHITECTURE: dict[str, str] = {"h100": "h200", "h800": "h200", "h20": "h200", "gh200": "h200"}
"""GPU kinds with no table of their own that read the table of a kind of the same architecture (Hopper,
sm90: the same kernels, the same tiles). Which backend is faster follows the architecture more than the
memory: on an H100 (2026-12-05, the slowest ranks of the documents placement at 8k tokens per GPU, cp 8-64,
four packed-document families) cuDNN, the H200 table's pick for them, ran the backward 1.4-2.4x and the
forward 1.06-1.28x as fast as FA4, which the capability rule picks (`docs/benchmarks/scaling.md`)."""


@cache
def load_kernel_table(gpu_kind: str) -> KernelTable | None:
    """The shipped table of ``gpu_kind`` ("h200", ...), else that of its architecture's measured kind
    (`SAME_ARCHITECTURE`: an H100 reads the H200's; the table's ``gpu_kind`` says whose it is), or None when
    neither was measured."""
    folder = resources.files("magi_solver").joinpath("kernel_tables")
    for kind in dict.fromkeys((gpu_kind, SAME_ARCHITECTURE.get(gpu_kind, gpu_kind))):
        if folder.joinpath(f"{kind}.json").is_file():
            return KernelTable.from_dict(json.loads(folder.joinpath(f"{kind}.json").read_text()))
    return None


def _distance(f: MaskFeatures, row: dict) -> float:
    """Rows of the other document-ness first never win; then size (log2), tile fill, slices per row."""
    tok = abs(math.log2(max(f.tokens, 1) / max(row["tokens"], 1)))
    spr = abs(math.log2(max(f.slices_per_row, 1e-3) / max(row["slices_per_row"], 1e-3)))
    return 8.0 * (f.documents != row["documents"]) + tok + 4.0 * abs(f.tile_fill - row["tile_fill"]) + spr


@dataclass(frozen=True, slots=True)
class KernelPick:
    """What ``auto`` picks on one measured row: the forward's and the backward's backend, and why."""

    forward: str
    backward: str
    reason: str


def pick_kernel(
    table: KernelTable | None,
    features: MaskFeatures,
    head_dim: int,
    candidates: Sequence[str],
    *,
    deterministic: bool = False,
) -> KernelPick | None:
    """The pick on the nearest row of ``head_dim`` among ``candidates`` (see the module docstring); None when
    the table has no such row or measured none of the candidates. Ties go by name, so every rank agrees.
    ``deterministic``: the rows measured in deterministic mode (default-mode rows when there are none, and
    the reason says so); otherwise the default-mode rows."""
    if table is None:
        return None
    rows = [r for r in table.rows if r["head_dim"] == head_dim]
    mode = ""
    if deterministic:
        det_rows = [r for r in rows if r.get("deterministic", False)]
        if det_rows:
            rows, mode = det_rows, "deterministic "
        else:
            rows = [r for r in rows if not r.get("deterministic", False)]
            mode = "default-mode (no deterministic rows measured for this head_dim) "
    else:
        rows = [r for r in rows if not r.get("deterministic", False)]
    if not rows:
        return None
    row = min(rows, key=lambda r: (_distance(features, r), r["mask"], r["tokens"]))
    ms = {b: row["ms"][b] for b in candidates if b in row["ms"]}
    if not ms:
        return None
    whole = min(ms, key=lambda b: (sum(ms[b]), b))

    def direction(i: int) -> str:
        best = min(ms, key=lambda b: (ms[b][i], b))
        return best if ms[best][i] < (1 - SPLIT_GAIN) * ms[whole][i] else whole

    fwd, bwd = direction(0), direction(1)
    times = ", ".join(f"{b} {ms[b][0]:.3f} / {ms[b][1]:.3f}" for b in sorted(ms))
    picked = fwd if fwd == bwd else f"{fwd} forward, {bwd} backward"
    reason = (
        f"{table.gpu_kind} table, nearest {mode}measured row {row['mask']} at {row['tokens']} tokens, d {head_dim} "
        f"(rank problem: {features.tokens} tokens, tile fill {features.tile_fill:.2f}, "
        f"{features.slices_per_row:.2f} slices per row{', documents' if features.documents else ''}): "
        f"{picked} (fwd / bwd ms: {times})"
    )
    return KernelPick(fwd, bwd, reason)


@dataclass(frozen=True, slots=True)
class RankProblems:
    """Every rank's attention problem after dispatch, as plain values every rank holds alike: the global mask,
    each rank's query rows and, in cross-attention, where the keys live. What ``auto``'s table is asked about
    (:func:`advise_kernel`); the features are computed only when asked (:meth:`features`)."""

    q_ranges: Sequence[Sequence[int]]
    """``[start, end)`` query range of each slice."""
    k_ranges: Sequence[Sequence[int]]
    """``[start, end)`` key range of each slice."""
    types: Sequence[int]
    """Each slice's mask type (int codes, names or ``AttnMaskType`` members)."""
    rank_rows: Sequence[np.ndarray]
    """Per rank, the global ids of its query rows (padding ids past the mask are fine)."""
    kv_layout: KVLayout | None = None
    """Cross-attention's key/value shards (None: each rank's own keys are its query tokens)."""

    def features(self) -> MaskFeatures:
        """The busiest rank's features, its keys in its kernel's order (:func:`busiest_rank_features` with
        :func:`kernel_key_ids`)."""
        keys = kernel_key_ids(self.rank_rows, self.kv_layout)
        return busiest_rank_features(self.q_ranges, self.k_ranges, self.types, self.rank_rows, rank_keys=keys)


@dataclass(frozen=True, slots=True)
class KernelAdvice:
    """``auto``'s answer for one key: the table's pick, or why the capabilities' priority stays."""

    pick: KernelPick | None
    """The pick on the nearest measured row (None: no pick; see ``reason``)."""
    reason: str = ""
    """Why there is no pick where a table was asked ("" when picked, or when there was nothing to ask)."""


def advise_kernel(
    gpu_kind: str,
    head_dim: int,
    candidates: Sequence[str],
    problems: RankProblems | Callable[[], MaskFeatures],
    *,
    deterministic: bool = False,
) -> KernelAdvice:
    """``auto``'s pick for one key among ``candidates`` (the backends every rank can run; empty when there is
    nothing to choose: an explicit backend, or ranks without a GPU) on the shipped table of ``gpu_kind``
    (:func:`pick_kernel`, its deterministic rows where ``deterministic``). The busiest rank's features are
    computed (from ``problems``, or by calling it) only when the table measured two of the candidates: a
    pure function of values every rank shares, so every rank picks alike."""
    if not candidates:
        return KernelAdvice(None)
    table = load_kernel_table(gpu_kind)
    if table is None:
        return KernelAdvice(
            None, f"auto: no measured kernel table for GPU kind {gpu_kind!r}; the capability rule"
        )
    measured = {name for row in table.rows for name in row["ms"]}
    named = [name for name in candidates if name in measured]
    if len(named) < 2:
        return KernelAdvice(None)
    features = problems.features() if isinstance(problems, RankProblems) else problems()
    picked = pick_kernel(table, features, head_dim, named, deterministic=deterministic)
    if picked is None:
        return KernelAdvice(
            None, f"auto: the {gpu_kind} table has no row for head_dim {head_dim}; the capability rule"
        )
    return KernelAdvice(picked)
