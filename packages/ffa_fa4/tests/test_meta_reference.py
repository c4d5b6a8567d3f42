"""The launch metadata of the host-side fast paths equals that of the straightforward implementations.

``varlen._entries`` / ``_open_groups`` (joining slices into windowed entries, with cheap rejections),
``blocks.tiles`` (tile classes from a dense sweep when the grid is small) and ``magi_ffa.intervals``'s row
pairs were rewritten for host time; the per-row versions they replace are kept here as references, and
every field of :func:`build_mask_meta` is compared on seeded masks of every kind of the mask-loop benchmark,
random overlapping slices and windowed documents.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from magi_ffa import intervals
from magi_ffa._slice import Slice
from magi_ffa.intervals import RowIntervals
from magi_ffa.testing import random_overlapping_slices
from magi_ffa.validation import host_slices
from magi_ffa_fa4 import blocks, varlen
from magi_ffa_fa4._launch_meta import build_mask_meta
from magi_ffa_fa4.testing import assert_same_meta, slice_tensors
from magi_ffa_fa4.varlen import _Entry, _group, _meet

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------- references: varlen entries
def _ref_slice_entry(s: Slice) -> _Entry:
    lq, lk = s.q_end - s.q_start, s.k_end - s.k_start
    corner = s.k_end - s.q_end
    right = (s.dk - corner, s.dk - corner) if s.is_causal else (lq - 1, None)
    left = (corner - s.dk_inv, corner - s.dk_inv) if s.is_inv_causal else (lk - 1, None)
    return _Entry(s.q_start, s.q_end, s.k_start, s.k_end, left, right)


def _ref_side(need: np.ndarray, cut: np.ndarray):
    floor = int(need[~cut].max()) if (~cut).any() else 0
    if not cut.any():
        return (max(floor, 0), None)
    exact = need[cut]
    value = int(exact[0])
    if value < 0 or value < floor or (exact != value).any():
        return None
    return (value, value)


def _ref_window_entry(run: Sequence[Slice]) -> _Entry | None:
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
    if (length <= 0).any() or (hi - lo != length).any():
        return None
    ka, kb = int(lo.min()), int(hi.max())
    corner = kb - qb
    left = _ref_side(rows + corner - lo, lo > ka)
    right = _ref_side(hi - 1 - rows - corner, hi < kb)
    return None if left is None or right is None else _Entry(qa, qb, ka, kb, left, right)


def _ref_entries(slices: Sequence[Slice]) -> list[_Entry]:
    out: list[_Entry] = []
    run: list[Slice] = []
    for s in sorted(slices, key=lambda x: (x.q_start, x.k_start)):
        joined = _ref_window_entry([*run, s]) if run and s.q_start == run[-1].q_end else None
        if joined is not None:
            run.append(s)
            out[-1] = joined
        else:
            run = [s]
            out.append(_ref_slice_entry(s))
    return out


def _ref_open_groups(slices: Sequence[Slice], max_groups: int, min_mean_rows: int):
    if not slices:
        return None
    entries = _ref_entries(slices)
    if sum(e.q_end - e.q_start for e in entries) < min_mean_rows * len(entries):
        return None
    return _group(entries, max_groups)


assert _meet((0, None), (1, 1)) == (1, 1)  # the grouping itself is shared, not re-implemented


# ------------------------------------------------------------------------------------ references: tiles
def _ref_tiles(iv, block_m: int, block_n: int):
    total_q, total_k = iv.total_q, iv.total_k
    dev = iv.starts.device
    num_n = -(-total_k // block_n)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    valid = iv.ends > iv.starts
    if total_q == 0 or total_k == 0 or not bool(valid.any()):
        return empty, empty.clone(), torch.zeros(0, dtype=torch.int8, device=dev)
    r, _ = valid.nonzero(as_tuple=True)
    a = iv.starts[valid].long()
    b = iv.ends[valid].long()
    m = r // block_m
    t_lo, t_hi = a // block_n, (b - 1) // block_n + 1
    f_lo = (a + block_n - 1) // block_n
    f_hi = torch.where(b >= total_k, num_n, b // block_n)
    has_f = f_hi > f_lo
    stride = num_n + 1
    keys = torch.cat(
        [m * stride + t_lo, m * stride + t_hi, (m * stride + f_lo)[has_f], (m * stride + f_hi)[has_f]]
    )
    one = torch.ones_like(a)
    d_t = torch.cat([one, -one, torch.zeros_like(a[has_f]), torch.zeros_like(a[has_f])])
    d_f = torch.cat([torch.zeros_like(a), torch.zeros_like(a), one[has_f], -one[has_f]])
    ukeys, inv = torch.unique(keys, sorted=True, return_inverse=True)
    st = torch.zeros(ukeys.shape[0], dtype=torch.int64, device=dev).index_add_(0, inv, d_t)
    sf = torch.zeros(ukeys.shape[0], dtype=torch.int64, device=dev).index_add_(0, inv, d_f)
    ct, cf = torch.cumsum(st, 0), torch.cumsum(sf, 0)
    um, un = ukeys // stride, ukeys % stride
    nxt_m = torch.cat([um[1:], torch.full((1,), -1, dtype=um.dtype, device=dev)])
    nxt_n = torch.cat([un[1:], torch.zeros(1, dtype=un.dtype, device=dev)])
    seg_end = torch.where(nxt_m == um, nxt_n, num_n)
    length = (seg_end - un).clamp(min=0)
    rows_in_m = (total_q - um * block_m).clamp(max=block_m)
    cls = torch.where(cf == rows_in_m, blocks.FULL, blocks.PARTIAL)
    length = torch.where(ct > 0, length, 0)
    seg = torch.repeat_interleave(torch.arange(ukeys.shape[0], device=dev), length)
    first = torch.cumsum(length, 0) - length
    n_out = un[seg] + torch.arange(seg.shape[0], device=dev) - first[seg]
    return um[seg], n_out, cls[seg].to(torch.int8)


# ------------------------------------------------------------------------------ references: row intervals
def _ref_slice_row_pairs(q_ranges, k_ranges, type_map):
    qs, qe = q_ranges[:, 0].long(), q_ranges[:, 1].long()
    ks, ke = k_ranges[:, 0].long(), k_ranges[:, 1].long()
    t = type_map.long()
    sq = (qe - qs).clamp(min=0)
    sid = torch.repeat_interleave(torch.arange(qs.shape[0], device=qs.device), sq)
    first = torch.cumsum(sq, 0) - sq
    rows = qs[sid] + torch.arange(sid.shape[0], device=qs.device) - first[sid]
    inv = (t[sid] & 2) != 0
    cau = (t[sid] & 1) != 0
    starts = ks[sid] + torch.where(inv, rows - qs[sid], 0)
    ends = ke[sid] - torch.where(cau, qe[sid] - rows - 1, 0)
    keep = starts < ends
    return rows[keep], starts[keep], ends[keep]


def _ref_merge_sorted_pairs(rows, starts, ends, total_q: int, total_k: int) -> RowIntervals:
    device = rows.device
    if rows.numel() == 0:
        z = torch.zeros(total_q, 1, dtype=torch.int32, device=device)
        return RowIntervals(z, z.clone(), torch.zeros(total_q, dtype=torch.int32, device=device), 1, total_k)
    order = torch.argsort(rows * (total_k + 1) + starts)
    rows, starts, ends = rows[order], starts[order], ends[order]
    off = rows * (total_k + 1)
    run_max = torch.cummax(off + ends, 0).values
    prev = torch.cat([torch.full((1,), -1, dtype=run_max.dtype, device=device), run_max[:-1]])
    new = (off + starts) > prev
    new[0] = True
    group = torch.cumsum(new.long(), 0) - 1
    n_groups = int(group[-1]) + 1
    g_rows = rows[new]
    g_starts = starts[new]
    last = torch.ones_like(new)
    last[:-1] = new[1:]
    g_ends = run_max[last] - g_rows * (total_k + 1)
    counts = torch.bincount(g_rows, minlength=total_q)
    width = max(int(counts.max()), 1)
    first_group = torch.cumsum(counts, 0) - counts
    slot = torch.arange(n_groups, device=device) - first_group[g_rows]
    st = torch.zeros(total_q, width, dtype=torch.int32, device=device)
    en = torch.zeros(total_q, width, dtype=torch.int32, device=device)
    st[g_rows, slot] = g_starts.to(torch.int32)
    en[g_rows, slot] = g_ends.to(torch.int32)
    return RowIntervals(st, en, counts.to(torch.int32), width, total_k)


_REF_MERGE = _ref_merge_sorted_pairs


# ------------------------------------------------------------------------------------------------- masks
def _windowed_docs(rng: random.Random, total: int):
    """Packed documents with a sliding window, decomposed as the runtime's helpers do (joins into entries)."""
    from magi_mask import decompose_region, tighten_region

    cuts = sorted({0, total, *(rng.randrange(1, total) for _ in range(rng.randrange(0, 6)))})
    left = rng.choice([None, rng.randrange(0, total)])
    right = rng.choice([None, 0, rng.randrange(0, total)])
    rows = []
    for s, e in itertools.pairwise(cuts):
        lo = s - e + 1 if left is None else -left
        hi = e - 1 - s if right is None else right
        rows += decompose_region(tighten_region(s, e, s, e, lo, hi))
    return [[a, b] for a, b, *_ in rows], [[c, d] for _, _, c, d, _ in rows], [t for *_, t in rows]


KINDS = ("random", "docs_causal", "stripes", "docs_full", "window", "prefix_docs", "short_docs")


def _docs(total: int, rng: random.Random, n: int) -> list[list[int]]:
    """``n`` documents of log-normal lengths (at least one token each) covering ``[0, total)``."""
    w = np.random.default_rng(rng.randrange(1 << 30)).lognormal(0.0, 1.0, n)
    cut = np.minimum(np.round(np.cumsum(w) / w.sum() * total).astype(int), total)
    cu = sorted({0, total, *cut.tolist()})
    return [list(d) for d in itertools.pairwise(cu)]


def _kind_mask(kind: str, total: int, rng: random.Random) -> tuple[list, list, list]:
    """The kinds of the new-mask loop benchmark (``benchmarks.mask_loop_bench``), drawn here so that this
    package's tests need nothing outside it."""
    if kind == "random":
        qr, kr, tm = random_overlapping_slices(rng, total, total, rng.randint(4, 40))
        keep = [i for i in range(len(qr)) if qr[i][1] > qr[i][0] and kr[i][1] > kr[i][0]]
        return [qr[i] for i in keep], [kr[i] for i in keep], [tm[i] for i in keep]
    if kind in ("docs_causal", "docs_full", "short_docs"):
        docs = _docs(
            total, rng, rng.randint(3, 12) if kind != "short_docs" else total // rng.randint(64, 200)
        )
        return docs, docs, [0 if kind == "docs_full" else 1] * len(docs)
    if kind == "stripes":  # overlapping row bands over narrow key bands: several intervals per row
        n = rng.randint(3, 9)
        qr = [[rng.randint(0, total // 8), total - rng.randint(0, total // 8)] for _ in range(n)]
        kr = [[s * total // n, s * total // n + rng.randint(16, max(17, total // (4 * n)))] for s in range(n)]
        return qr, kr, [0] * (n - 1) + [rng.choice([1, 2, 3])]
    if kind == "window":  # a sliding window: its causal head and its band
        w = rng.randint(64, total // 4)
        return [[0, w], [w, total]], [[0, w], [1, total]], [1, 3]
    p = rng.randint(total // 32, total // 8)  # documents that also see a shared prefix
    docs = [[a + p, b + p] for a, b in _docs(total - p, rng, rng.randint(2, 8))]
    return docs + docs, docs + [[0, p]] * len(docs), [1] * len(docs) + [0] * len(docs)


def _masks():
    out = []
    for step in range(2 * len(KINDS)):  # every kind at 16k and at 4k tokens
        total = 16384 if step < len(KINDS) else 4096
        kind = KINDS[step % len(KINDS)]
        qr, kr, tm = _kind_mask(kind, total, random.Random(7 + step))
        out.append((f"{kind}-{total}", qr, kr, tm, total, total))
    for seed in range(10):  # random overlapping slices of all types, q and k of different lengths
        rng = random.Random(seed)
        tq, tk = rng.choice([(300, 300), (1000, 700), (2048, 4096), (5000, 5000)])
        qr, kr, tm = random_overlapping_slices(rng, tq, tk, rng.randint(1, 40))
        out.append((f"random-{seed}", qr, kr, tm, tq, tk))
    for seed in range(8):
        rng = random.Random(100 + seed)
        total = rng.choice([257, 1024, 3000, 8192])
        qr, kr, tm = _windowed_docs(rng, total)
        out.append((f"window-docs-{seed}", qr, kr, tm, total, total))
    return out


MASKS = _masks()


@pytest.mark.parametrize("case", MASKS, ids=[c[0] for c in MASKS])
def test_entries_and_groups_match_reference(case) -> None:
    _, qr, kr, tm, tq, tk = case
    slices = host_slices(*slice_tensors(qr, kr, tm), tq, tk)
    assert varlen._entries(slices) == _ref_entries(slices)
    for max_groups, min_mean_rows in itertools.product((1, 2, 8, 10**6), (0, 64, 256)):
        got = varlen._open_groups(slices, max_groups, min_mean_rows)
        want = _ref_open_groups(slices, max_groups, min_mean_rows)
        assert got == want, (max_groups, min_mean_rows)


@pytest.mark.parametrize("case", MASKS, ids=[c[0] for c in MASKS])
def test_tiles_and_row_intervals_match_reference(case, monkeypatch) -> None:
    _, qr, kr, tm, tq, tk = case
    q, k, t = slice_tensors(qr, kr, tm)
    got = intervals.row_intervals_reference(q, k, t, tq, tk)
    want = _REF_MERGE(*_ref_slice_row_pairs(q, k, t), tq, tk)
    assert_same_meta(got, want, path="row_intervals")
    for bm, bn in ((128, 128), (256, 128), (64, 32), (16, 16), (100, 300)):
        want_tiles = _ref_tiles(want, bm, bn)
        for dense in (0, 16, 10**9):  # the sort, the default choice, the dense sweep
            monkeypatch.setattr(blocks, "_DENSE_CELLS_PER_SLOT", dense)
            assert_same_meta(blocks.tiles(got, bm, bn), want_tiles, path=f"tiles {bm}x{bn} dense {dense}")


@pytest.mark.parametrize("varlen_env", ["1", "0"])
@pytest.mark.parametrize("case", MASKS, ids=[c[0] for c in MASKS])
def test_launch_meta_matches_reference(case, varlen_env, monkeypatch) -> None:
    _, qr, kr, tm, tq, tk = case
    monkeypatch.setenv("MAGI_FFA_FA4_VARLEN", varlen_env)
    args = (*slice_tensors(qr, kr, tm), tq, tk, CPU)
    got = build_mask_meta(*args)
    monkeypatch.setattr(varlen, "_open_groups", _ref_open_groups)
    monkeypatch.setattr(blocks, "tiles", _ref_tiles)
    monkeypatch.setattr(intervals, "slice_row_pairs", _ref_slice_row_pairs)
    monkeypatch.setattr(intervals, "_merge_sorted_pairs", _REF_MERGE)
    assert_same_meta(got, build_mask_meta(*args))


@pytest.mark.parametrize("seed", range(300))
def test_small_masks_match_reference(seed: int, monkeypatch) -> None:
    """Tiny masks of every type, many seeds: slices on consecutive rows meet at every kind of seam (the
    cheap join rejection must never reject a join), slices with empty rows, tails of partial tiles."""
    rng = random.Random(seed)
    tq, tk = rng.randint(1, 48), rng.randint(1, 48)
    if seed % 3 == 0:
        qr, kr, tm = _windowed_docs(rng, max(tq, 2))
        tk = tq = max(tq, 2)
    else:
        qr, kr, tm = random_overlapping_slices(rng, tq, tk, rng.randint(1, 8))
        if seed % 3 == 1:  # stack the slices on consecutive rows so that many of them are join candidates
            cuts = sorted(rng.randrange(tq + 1) for _ in range(len(qr) + 1))
            qr = [[a, b] for a, b in itertools.pairwise(cuts)]
    q, k, t = slice_tensors(qr, kr, tm)
    slices = host_slices(q, k, t, tq, tk)
    assert varlen._entries(slices) == _ref_entries(slices)
    for max_groups, min_mean_rows in itertools.product((1, 3, 10**6), (0, 4, 16)):
        assert varlen._open_groups(slices, max_groups, min_mean_rows) == _ref_open_groups(
            slices, max_groups, min_mean_rows
        )
    got = intervals.row_intervals_reference(q, k, t, tq, tk)
    want = _REF_MERGE(*_ref_slice_row_pairs(q, k, t), tq, tk)
    assert_same_meta(got, want, path="row_intervals")
    for bm, bn in ((4, 4), (16, 8), (64, 64)):
        want_tiles = _ref_tiles(want, bm, bn)
        for dense in (0, 10**9):
            monkeypatch.setattr(blocks, "_DENSE_CELLS_PER_SLOT", dense)
            assert_same_meta(blocks.tiles(got, bm, bn), want_tiles, path=f"tiles {bm}x{bn} dense {dense}")
