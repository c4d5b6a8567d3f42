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

Cost: per tile the device evaluates the mask (at b, h = 0, 0 and 1, 1), compares the two, marks where each
row changes between hidden and visible, and finds the marks 8 bytes at a time; the host then receives one
array per tile (the marks and the b/h verdict) and folds the tile's rows with numpy, so Python work grows
with the number of tiles and of output slices, not with the number of rows.

On a GPU a faster pass comes first: the mask_mod, the b/h comparison and a few row reductions compiled
into one kernel with ``torch.compile``, so the mask never reaches memory. With the count and the first and
last visible key, a row whose visible keys are one run is fully described; when the first tile shows rows
of two runs (a sliding window plus sink tokens, say), the kernel also evaluates each element's left
neighbour, and the number and extreme positions of run starts and ends describe rows of up to two runs.
Only tiles holding a row with more runs go through the marking pass above. A mask_mod that
``torch.compile`` cannot trace, or a mask whose first tile is mostly rows of more than two runs, takes the
marking pass everywhere (same result, slower); ``MAGI_ATTENTION_MASK_MOD_COMPILE=0`` turns the compiled
pass off. Compiling costs seconds, so masks under ``_COMPILED_MIN_ELEMENTS`` (about 512K x 512K) take the
marking pass.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from magi_solver import AttnMaskType, AttnRanges

from . import env
from ._lru import remember

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_CPU_TILE_ELEMENTS = 1 << 21
"""Mask elements per tile on the CPU (a band of rows across all keys): 2 M bools, so a tile and the
mask_mod's temporaries (int64 ones 16 MB) stay near the caches. Measured on 2 cores at 16K x 16K: the
fastest size; a sliding window takes about 1.4x as long with 4 M-element tiles and 2.5x with 16 M, the other
masks about as long with either."""

_GPU_TILE_ELEMENTS = 1 << 28
"""Mask elements per tile on a GPU: 256 M bools (256 MB; a mask_mod's int64 temporaries 2 GB each), large
enough that the per-tile launches and the two host syncs per tile (finding the marks, then one transfer)
cost little next to the evaluation (a 1M x 1M mask is 4096 tiles)."""

_COMPILED_MAX_UNRESOLVED_SHARE = 0.5
"""The compiled pass is skipped when more than this share of the first tile's rows have more than two runs
of visible keys: those rows need the marking pass anyway, so the compiled one would only add work."""

_TYPES = (AttnMaskType.FULL, AttnMaskType.CAUSAL, AttnMaskType.INV_CAUSAL, AttnMaskType.BI_CAUSAL)
"""Slice type by slope code ``2 * start_step + end_step`` (each step 0 or 1 key per row)."""


def _tile_elements(device: torch.device) -> int:
    return _CPU_TILE_ELEMENTS if device.type == "cpu" else _GPU_TILE_ELEMENTS


def _use_compiled_pass(device: torch.device) -> bool:
    """The compiled pass runs on GPUs only (unless MAGI_ATTENTION_MASK_MOD_COMPILE is false): on the CPU the
    marking pass already meets its time budget and a C++ compile would cost more than it saves."""
    return device.type == "cuda" and env.mask_mod_compile()


# -- the fold: rows of key intervals -> slices (host, numpy) ---------------------------------------------
def _ranks(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of sizes ``counts``: each item's group index and its rank within its group."""
    group = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return group, np.arange(len(group)) - first[group]


@dataclass(slots=True)
class _Open:
    """The slice group still open after the rows folded so far (its ``n`` intervals run in parallel)."""

    first_row: int
    start0: np.ndarray
    end0: np.ndarray
    codes: np.ndarray | None  # slope code per interval once the group has two rows
    last_start: np.ndarray
    last_end: np.ndarray


@dataclass
class _Folder:
    """Folds consecutive rows of sorted key intervals into slices, one batch of rows at a time.

    The rule (greedy, row by row): a row joins the group above it when it has as many intervals as the row
    before and each interval's (start, end) moved by (0 or 1, 0 or 1) keys; the group's second row fixes
    each interval's slopes and every later row must repeat them. Any other row, and a row after an empty
    one, starts a new group. The batch is folded with array operations, not row by row: a row whose steps
    are valid ("compatible") surely joins when its steps equal the row before's or the row before was not
    compatible (an "anchor"); after an anchor, compatible rows whose steps differ from the row before
    alternate: the first starts a group, the next is that group's second row, the next starts one, ...
    So only the parity of the distance to the last anchor is needed. The last group of a batch stays open
    (``open``) and is carried into the next batch as its row 0.
    """

    next_row: int = 0
    open: _Open | None = None
    out: list[np.ndarray] = field(default_factory=list)  # [5, n] blocks: q start, q end, k start, k end, code

    def add(self, counts: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Rows ``next_row ..`` with ``counts[i]`` intervals each, flattened in ``starts`` / ``ends`` (int64)."""
        nrows = len(counts)
        if nrows == 0:
            return
        row0, op = self.next_row, self.open
        self.next_row += nrows
        # row 0 of the batch is the last row folded before (empty when there is no open group)
        n0 = 0 if op is None else len(op.start0)
        cnt = np.concatenate([[n0], counts]).astype(np.int64)
        s = np.concatenate([op.last_start, starts]) if op is not None else starts
        e = np.concatenate([op.last_end, ends]) if op is not None else ends
        off = np.concatenate([[0], np.cumsum(cnt)])
        row_of, _ = _ranks(cnt)
        flat = np.arange(len(s))
        prev = np.maximum(flat - cnt[row_of], 0)  # the same interval one row up (valid when counts agree)
        ds, de = s - s[prev], e - e[prev]
        code = np.where((ds >= 0) & (ds <= 1) & (de >= 0) & (de <= 1), 2 * ds + de, -1)
        code[:n0] = -1 if op is None or op.codes is None else op.codes

        def per_row(flags: np.ndarray) -> np.ndarray:
            c = np.concatenate([[0], np.cumsum(flags)])
            return c[off[1:]] - c[off[:-1]]

        compat = np.zeros(nrows + 1, dtype=bool)
        compat[0] = op is not None and op.codes is not None
        compat[1:] = (cnt[1:] > 0) & (cnt[1:] == cnt[:-1]) & (per_row(code < 0)[1:] == 0)
        same = np.zeros(nrows + 1, dtype=bool)
        same[1:] = compat[1:] & (per_row(code != code[prev])[1:] == 0)
        anchor = compat.copy()
        anchor[1:] &= same[1:] | ~compat[:-1]
        idx = np.arange(nrows + 1)
        last_anchor = np.maximum.accumulate(np.where(anchor, idx, -1))
        starts_group = ~compat | (~anchor & ((idx - last_anchor) % 2 == 1))
        starts_group[0] = True  # batch row 0 begins the batch's first group (the open one)

        bounds = np.flatnonzero(starts_group)
        g_first, g_last = bounds, np.append(bounds[1:] - 1, nrows)
        # per-row roles: where a group starting here begins (the open group keeps its own first row)
        first_s, first_e = s.copy(), e.copy()
        if op is not None:
            first_s[:n0], first_e[:n0] = op.start0, op.end0
        q_first = row0 - 1 + idx
        if op is not None:
            q_first[0] = op.first_row
        has_slopes = (g_last > g_first) | ((g_first == 0) & compat[0])
        slope_row = np.where(g_last > g_first, g_first + 1, g_first)

        closed = slice(0, len(bounds) - 1)  # the last group stays open for the next batch
        gn = cnt[g_first[closed]]
        grp, j = _ranks(gn)
        if len(grp):
            f_first = off[g_first[closed]][grp] + j
            f_last = off[g_last[closed]][grp] + j
            c = np.where(has_slopes[closed][grp], code[off[slope_row[closed]][grp] + j], 0)
            k_end = np.where(c & 1, e[f_last], first_e[f_first])
            q_s = q_first[g_first[closed]][grp]
            q_e = row0 + g_last[closed][grp]
            self.out.append(np.stack([q_s, q_e, first_s[f_first], k_end, c]))

        i = bounds[-1]
        n = cnt[i]
        if n == 0:
            self.open = None
            return
        last = slice(off[nrows], off[nrows] + n)
        if i == 0 and op is not None:  # the open group went on through the batch: row 1 has its slopes
            self.open = _Open(op.first_row, op.start0, op.end0, code[off[1] : off[1] + n], s[last], e[last])
        else:
            codes = code[off[i + 1] : off[i + 1] + n] if i < nrows else None
            sl = slice(off[i], off[i] + n)
            self.open = _Open(row0 - 1 + i, s[sl], e[sl], codes, s[last], e[last])

    def finish(self) -> np.ndarray:
        """All slices, ``[5, n]`` int64: q start, q end, k start, k end, slope code (see ``_TYPES``)."""
        op = self.open
        if op is not None:
            c = op.codes if op.codes is not None else np.zeros(len(op.start0), dtype=np.int64)
            n = len(c)
            k_end = np.where(c & 1, op.last_end, op.end0)
            self.out.append(
                np.stack([np.full(n, op.first_row), np.full(n, self.next_row), op.start0, k_end, c])
            )
            self.open = None
        return np.concatenate(self.out, axis=1) if self.out else np.zeros((5, 0), dtype=np.int64)


# -- the device side: a tile -> its rows' key intervals ----------------------------------------------------
def _check_positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def _evaluate(
    mask_mod: MaskMod, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
) -> torch.Tensor:
    dev = q_idx.device
    out = mask_mod(b, h, q_idx, kv_idx)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"`mask_mod` must return a bool tensor, got {type(out).__name__}")
    if out.dtype != torch.bool:
        raise TypeError(f"`mask_mod` must return a bool tensor, got dtype {out.dtype}")
    if out.device != dev:
        raise ValueError(f"`mask_mod` returned a tensor on {out.device}; it must stay on `device` ({dev})")
    try:
        return torch.broadcast_to(out, (q_idx.shape[0], kv_idx.shape[1]))
    except RuntimeError:
        raise ValueError(
            f"`mask_mod` returned shape {tuple(out.shape)} for q_idx {tuple(q_idx.shape)} and kv_idx "
            f"{tuple(kv_idx.shape)}: it must broadcast elementwise over q_idx and kv_idx"
        ) from None


def _words(x: torch.Tensor) -> torch.Tensor | None:
    """A contiguous bool tensor read as int64 words (8 elements each), or None when it cannot be."""
    if not x.is_contiguous() or x.numel() % 8:
        return None
    try:
        return x.reshape(-1).view(torch.int64)
    except RuntimeError:  # storage offset not 8-aligned
        return None


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """0-d bool on the device: whether ``a`` and ``b`` differ anywhere (no host sync)."""
    wa, wb = _words(a), _words(b)
    if wa is not None and wb is not None:
        return torch.ne(wa, wb).any()  # 8x fewer elements than comparing bools
    return torch.ne(a, b).any()


@dataclass(slots=True)
class _Tile:
    """What a tile leaves on the device for the host: all of it comes back in one transfer."""

    row0: int
    rows: int
    keys: int
    pairs: tuple[tuple[int, int], ...]
    head: torch.Tensor  # int64 [len(pairs) + rows]: the b/h verdicts, then each row's edges (see _launch)


def _launch(
    mask_mod: MaskMod, row0: int, rows: int, kv_idx: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]
) -> tuple[_Tile, torch.Tensor]:
    """Evaluate rows ``row0 ..`` of the mask and mark its changes; returns the tile and the marks as words.

    Enqueues device work only, no host sync (``index`` holds 0-d tensors 0 and 1 for b and h, made once:
    a new one per call would be a copy to the device, which syncs). The marks: over the tile read row after
    row, ``change[p]`` = element ``p + 1`` differs from element ``p`` (one flat contiguous comparison; the
    marks between one row's last key and the next row's first are dropped on the host). They go into a
    fresh buffer padded to whole int64 words, so that the few marks are found 8 at a time.
    """
    dev, keys = kv_idx.device, kv_idx.shape[1]
    q_idx = torch.arange(row0, row0 + rows, device=dev)[:, None]
    tile = _evaluate(mask_mod, index[0], index[0], q_idx, kv_idx)
    # (1, 1) on every tile catches a mask that follows b or h; (1, 0) on the first tile one that follows
    # only their combination
    pairs = ((1, 1), (1, 0)) if row0 == 0 else ((1, 1),)
    verdicts = [_differs(tile, _evaluate(mask_mod, index[b], index[h], q_idx, kv_idx)) for b, h in pairs]
    flat = tile.reshape(-1)  # a view, unless the mask_mod returned a broadcast (then a copy)
    n = flat.numel() - 1
    buf = torch.empty(-(-n // 8) * 8, dtype=torch.bool, device=dev)
    buf[n:] = False
    torch.ne(flat[1:], flat[:-1], out=buf[:n])
    # row edges: visible at key 0 opens an interval there, visible at the last key closes one at `keys`
    edges = tile[:, 0].to(torch.int64) + 2 * tile[:, -1].to(torch.int64)
    head = torch.cat([torch.stack(verdicts).to(torch.int64), edges])
    return _Tile(row0, rows, keys, pairs, head), buf.view(torch.int64)


def _finish(tile: _Tile, words: torch.Tensor) -> np.ndarray:
    """Find the marked words (one sync) and bring everything to the host in one transfer."""
    hit = words.nonzero().squeeze(1)
    return torch.cat([tile.head, hit, words[hit]]).cpu().numpy()


def _intervals(tile: _Tile, host: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of the tile: its interval count, and all intervals' starts and ends (flattened, row-major)."""
    npairs, rows, keys = len(tile.pairs), tile.rows, tile.keys
    edges = host[npairs : npairs + rows]
    hit, vals = np.split(host[npairs + rows :], 2)
    # the marked bytes of each hit word (a byte copy both ways, so no byte-order question) -> flat positions
    word_i, byte_i = np.nonzero(vals.view(np.uint8).reshape(-1, 8))
    mark_row, mark_col = np.divmod(hit[word_i] * 8 + byte_i, keys)
    inside = mark_col < keys - 1  # not a mark between two rows
    mark_row, mark_col = mark_row[inside], mark_col[inside]
    first, last = edges & 1, edges >> 1
    marks = np.bincount(mark_row, minlength=rows)
    per_row = first + marks + last
    out_off = np.cumsum(per_row) - per_row
    bounds = np.empty(int(per_row.sum()), dtype=np.int64)
    bounds[out_off[first == 1]] = 0
    bounds[out_off[mark_row] + first[mark_row] + _ranks(marks)[1]] = mark_col + 1
    bounds[(out_off + per_row - 1)[last == 1]] = keys
    # along a row the boundaries alternate: start, end, start, end, ...
    return per_row // 2, bounds[0::2], bounds[1::2]


# -- the compiled pass: a tile -> per-row run statistics, the mask never in memory ---------------------------
@dataclass(slots=True)
class _RunStats:
    """Per row (numpy, int64): the runs of visible keys when there are at most two, and whether
    b, h = 1, 1 disagrees. ``runs`` is 0, 1, 2, or ``_MANY_RUNS`` (more than the kernel resolves); the runs
    are ``[first, end_first)`` and ``[start_last, last + 1)`` (the same run when ``runs == 1``)."""

    runs: np.ndarray
    first: np.ndarray
    end_first: np.ndarray
    start_last: np.ndarray
    last: np.ndarray
    differs: np.ndarray

    def intervals(self, rows: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(counts, starts, ends)`` of ``rows`` (each with at most two runs), as ``_Folder.add`` takes."""
        runs = self.runs[rows]
        starts = np.stack([self.first[rows], self.start_last[rows]], axis=1)
        end0 = np.where(runs == 1, self.last[rows] + 1, self.end_first[rows])
        ends = np.stack([end0, self.last[rows] + 1], axis=1)
        used = np.arange(2)[None, :] < runs[:, None]  # row-major: a row's runs stay together, in order
        return runs, starts[used], ends[used]


_MANY_RUNS = 3


def _run_stats_tile(
    mask_mod: MaskMod,
    first_row: torch.Tensor,
    offsets: torch.Tensor,
    kv_idx: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor],
    total_rows: int,
    two_runs: bool,
) -> torch.Tensor:
    """``[6, rows]`` int64 for rows ``first_row + offsets`` (rows past the end repeat the last row), the
    fields of ``_RunStats`` in order.

    One run (``two_runs`` False): from the count and the first / last visible key, a row is one run when
    ``count == last - first + 1``, else ``_MANY_RUNS``. Two runs: the mask is also evaluated one key to the
    left, so run starts (visible, left hidden) and ends (hidden, left visible) are elementwise: their count
    and extreme positions give both runs of a row with at most two (50% more evaluation; used when the
    first tile shows such rows)."""
    rows, keys = offsets.shape[0], kv_idx.shape[1]
    q_idx = torch.clamp(first_row + offsets, max=total_rows - 1)[:, None]
    zero, one = index
    seen = torch.broadcast_to(mask_mod(zero, zero, q_idx, kv_idx), (rows, keys))
    other = torch.broadcast_to(mask_mod(one, one, q_idx, kv_idx), (rows, keys))
    differs = (seen != other).any(1).to(torch.int64)
    first = torch.where(seen, kv_idx, keys).amin(1)
    last = torch.where(seen, kv_idx, -1).amax(1)
    if not two_runs:
        count = seen.sum(1, dtype=torch.int64)
        runs = torch.where(count == 0, 0, torch.where(count == last - first + 1, 1, _MANY_RUNS))
        return torch.stack([runs, first, last + 1, first, last, differs])
    left_idx = torch.clamp(kv_idx - 1, min=0)  # never an index the mask_mod has not been asked about
    left = torch.broadcast_to(mask_mod(zero, zero, q_idx, left_idx), (rows, keys)) & (kv_idx > 0)
    rise = seen & ~left
    fall = left & ~seen
    runs = torch.clamp(rise.sum(1, dtype=torch.int64), max=_MANY_RUNS)
    end_first = torch.where(fall, kv_idx, keys).amin(1)
    start_last = torch.where(rise, kv_idx, -1).amax(1)
    return torch.stack([runs, first, end_first, start_last, last, differs])


_COMPILED: OrderedDict[tuple, Callable | None] = OrderedDict()
"""Compiled ``_run_stats_tile`` per ``_stats_key``, least recently used first; None where compiling or
running it failed. Each entry compiles its own copy of the function's code: torch.compile keeps its cache
on the code object with a limit of a few variants, which different mask_mods and sizes would otherwise
exhaust."""

_NOT_COMPILED = object()

_COMPILED_ENTRIES = 16

_COMPILED_MIN_ELEMENTS = 1 << 38
"""Masks smaller than this (about 512K x 512K) take the marking pass: compiling costs seconds, the marking
pass evaluates about 75 G elements a second on an H200, so compiling pays off only on masks about this
large."""


def _stats_key(
    mask_mod: MaskMod, rows: int, keys: int, total_rows: int, dev: torch.device, two_runs: bool
) -> tuple:
    """What a compiled ``_run_stats_tile`` is specialised on (its entry in ``_COMPILED``)."""
    return (getattr(mask_mod, "__code__", type(mask_mod)), rows, keys, total_rows, str(dev), two_runs)


def _compiled_stats_fn(cache_key: tuple) -> Callable | None:
    """The compiled ``_run_stats_tile`` for ``cache_key``, or None when it failed before."""
    fn = _COMPILED.pop(cache_key, _NOT_COMPILED)
    if fn is _NOT_COMPILED:
        code = _run_stats_tile.__code__.replace()  # a new code object: its own compile cache
        fresh = types.FunctionType(code, _run_stats_tile.__globals__, _run_stats_tile.__name__)
        fn = torch.compile(fresh, fullgraph=True, dynamic=False)
    return remember(_COMPILED, cache_key, fn, _COMPILED_ENTRIES)


def _compiled_run_stats(
    mask_mod: MaskMod,
    row0: int,
    total_rows: int,
    rows_per_tile: int,
    kv_idx: torch.Tensor,
    index,
    two_runs: bool,
) -> _RunStats | None:
    """Rows ``row0 ..`` of the mask as ``_RunStats``, from one compiled kernel per tile; None when
    ``torch.compile`` cannot handle the mask_mod (the caller then marks every tile).

    Every tile has the same shape (the last one's surplus rows repeat the final row and are dropped), and the
    tile's first row is a tensor argument, so one compilation serves the whole mask. The results stay on the
    device until one transfer at the end.
    """
    dev, keys = kv_idx.device, kv_idx.shape[1]
    rows = min(rows_per_tile, total_rows - row0)
    offsets = torch.arange(rows, device=dev)
    key = _stats_key(mask_mod, rows, keys, total_rows, dev, two_runs)
    fn = _compiled_stats_fn(key)
    if fn is None:
        return None
    row_tensors = torch.arange(row0, total_rows, rows, device=dev)  # one copy to the device, not one per tile
    try:
        # the first call traces and compiles (or finds a compiled variant); every later tile must reuse
        # that compilation: a mask_mod whose guards change between tiles (Python state it mutates, say) would
        # otherwise recompile tile after tile. Either failure, or a mask_mod dynamo cannot capture whole,
        # means "use the marking pass", never a silently uncompiled run.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            parts = [fn(mask_mod, row_tensors[0], offsets, kv_idx, index, total_rows, two_runs)]
        with torch.compiler.set_stance("fail_on_recompile"):
            parts += [
                fn(mask_mod, row_tensors[i], offsets, kv_idx, index, total_rows, two_runs)
                for i in range(1, len(row_tensors))
            ]
    except Exception:
        _COMPILED[key] = None  # known to fail: the marking pass straight away next time
        return None
    host = torch.cat(parts, dim=1)[:, : total_rows - row0].cpu().numpy()
    return _RunStats(*host)


def _raise_if_batch_or_head_dependent(pairs, verdicts, row0: int, row1: int) -> None:
    for (b, h), differs in zip(pairs, verdicts):
        if differs:
            raise ValueError(
                "`mask_mod` depends on the batch or head index (rows "
                f"{row0}..{row1 - 1} differ between b, h = 0, 0 and {b}, {h}); a slice mask is the same "
                "for every batch element and head"
            )


def _marked_rows(mask_mod: MaskMod, row0: int, row1: int, rows_per_tile: int, kv_idx: torch.Tensor, index):
    """Rows ``row0 .. row1 - 1`` by the marking pass: yields ``(counts, starts, ends)`` per tile."""
    if row0 >= row1:
        return
    nxt = _launch(mask_mod, row0, min(row1 - row0, rows_per_tile), kv_idx, index)
    while nxt is not None:
        tile, words = nxt
        host = _finish(tile, words)
        del words
        r1 = tile.row0 + tile.rows
        _raise_if_batch_or_head_dependent(tile.pairs, host[: len(tile.pairs)], tile.row0, r1)
        # the next tile's device work is enqueued before this tile is folded, so the two overlap on a GPU
        nxt = _launch(mask_mod, r1, min(row1 - r1, rows_per_tile), kv_idx, index) if r1 < row1 else None
        yield _intervals(tile, host)


def _fold_run_stats(
    folder: _Folder,
    stats: _RunStats,
    mask_mod: MaskMod,
    row0: int,
    tq: int,
    rows_per_tile: int,
    kv_idx,
    index,
) -> None:
    """Fold rows ``row0 .. tq - 1`` from their run statistics; tiles holding a row of more runs than the
    statistics resolve go through the marking pass instead (in row order, so the fold sees every row once,
    in order)."""
    tile_of = np.arange(tq - row0) // rows_per_tile
    multi_tiles = np.unique(tile_of[stats.runs == _MANY_RUNS])
    # b/h disagreement found by the compiled pass, reported with the tile's rows as the marking pass does
    bad = np.flatnonzero(stats.differs)
    if len(bad):
        t0 = row0 + tile_of[bad[0]] * rows_per_tile
        _raise_if_batch_or_head_dependent(((1, 1),), (True,), t0, min(t0 + rows_per_tile, tq))
    done = 0  # rows folded so far, relative to row0
    for t in [*multi_tiles.tolist(), None]:
        upto = (tq - row0) if t is None else t * rows_per_tile
        if upto > done:  # the resolved rows before this tile, in one batch
            folder.add(*stats.intervals(slice(done, upto)))
        if t is None:
            break
        lo = row0 + t * rows_per_tile
        hi = min(lo + rows_per_tile, tq)
        for batch in _marked_rows(mask_mod, lo, hi, rows_per_tile, kv_idx, index):
            folder.add(*batch)
        done = hi - row0


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
            bands of rows (about 2 M elements at a time on the CPU, 256 M on a GPU), never whole.

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
    rows_per_tile = max(1, _tile_elements(dev) // tk)
    index = (torch.tensor(0, device=dev), torch.tensor(1, device=dev))
    folder = _Folder()
    # the first tile always takes the marking pass: it checks the mask_mod's output (type, device, shape),
    # its dependence on b and h at (1, 0) too, and shows whether the compiled pass can pay off
    first_rows = min(tq, rows_per_tile)
    counts, starts, ends = next(_marked_rows(mask_mod, 0, first_rows, rows_per_tile, kv_idx, index))
    folder.add(counts, starts, ends)
    stats = None
    if first_rows < tq and _use_compiled_pass(dev):
        # the cheaper kernel when the first tile's rows are mostly single runs, the two-run one when they
        # mostly have at most two; otherwise most tiles would need the marking pass anyway
        two_runs = bool(np.mean(counts > 1) > _COMPILED_MAX_UNRESOLVED_SHARE)  # Python bool: static
        resolvable = np.mean(counts > 1 + two_runs) <= _COMPILED_MAX_UNRESOLVED_SHARE
        if resolvable and tq * tk >= _COMPILED_MIN_ELEMENTS:
            stats = _compiled_run_stats(mask_mod, first_rows, tq, rows_per_tile, kv_idx, index, two_runs)
    if stats is None:
        for batch in _marked_rows(mask_mod, first_rows, tq, rows_per_tile, kv_idx, index):
            folder.add(*batch)
    else:
        _fold_run_stats(folder, stats, mask_mod, first_rows, tq, rows_per_tile, kv_idx, index)
    qs, qe, ks, ke, code = folder.finish().tolist()
    q = AttnRanges.from_bounds(qs, qe)  # millions of slices for an unstructured mask: the cheap constructor
    k = AttnRanges.from_bounds(ks, ke)
    return q, k, [_TYPES[c] for c in code]
