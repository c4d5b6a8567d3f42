"""FlexAttention mask_mod -> slices: exact (dense equality), compact on structured masks, strict on bad input;
the vectorised row fold equals a row-by-row one; the GPU path equals the CPU one (with a GPU)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_attention import mask_mod as mm
from magi_attention.api import calc_attn, infer_attn_mask_from_mask_mod, magi_attn_flex_key
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_solver import AttnMaskType

CUDA = torch.cuda.is_available()


def _dense(mask_mod, tq: int, tk: int) -> torch.Tensor:
    q, k = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    return torch.broadcast_to(mask_mod(torch.tensor(0), torch.tensor(0), q, k), (tq, tk))


def _union(q_ranges, k_ranges, types, tq: int, tk: int) -> torch.Tensor:
    qr = [[r.start, r.end] for r in q_ranges]
    kr = [[r.start, r.end] for r in k_ranges]
    return make_attn_mask(qr, kr, [t.code for t in types], tq, tk)


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _family(name: str, doc: torch.Tensor, param: int, table: torch.Tensor | None):
    starts = torch.zeros_like(doc)
    for d in range(int(doc.max()) + 1):
        starts[doc == d] = int((doc == d).nonzero()[0, 0])

    def same_doc(q, k):
        return doc[q] == doc[k]

    return {
        "doc_causal": lambda b, h, q, k: same_doc(q, k) & (q >= k),
        "doc_full": lambda b, h, q, k: same_doc(q, k),
        "window": lambda b, h, q, k: same_doc(q, k) & (q >= k) & (q - k <= param),
        "bidir_window": lambda b, h, q, k: same_doc(q, k) & ((q - k).abs() <= param),
        "prefix_lm": lambda b, h, q, k: same_doc(q, k) & ((q >= k) | (k - starts[k] < param)),
        "random_table": lambda b, h, q, k: table[q, k],
    }[name]


FAMILIES = ["doc_causal", "doc_full", "window", "bidir_window", "prefix_lm", "random_table"]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(FAMILIES),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    param=st.integers(0, 12),
    seed=st.integers(0, 2**16),
    tile_rows=st.sampled_from([1, 7, 1000]),
)
def test_union_equals_the_mask(name, lengths, param, seed, tile_rows) -> None:
    total = sum(lengths)
    doc = _doc_ids(lengths)
    table = torch.rand(total, total, generator=torch.Generator().manual_seed(seed)) < 0.4
    fn = _family(name, doc, param, table)
    old = mm._CPU_TILE_ELEMENTS
    mm._CPU_TILE_ELEMENTS = tile_rows * total  # tiles of `tile_rows` rows: results must not depend on tiling
    try:
        q, k, t = infer_attn_mask_from_mask_mod(fn, total, total)
    finally:
        mm._CPU_TILE_ELEMENTS = old
    assert torch.equal(_union(q, k, t, total, total), _dense(fn, total, total))


@settings(max_examples=40, deadline=None)
@given(
    tq=st.integers(1, 40),
    tk=st.integers(1, 70),
    density=st.sampled_from([0.05, 0.5, 0.95]),
    seed=st.integers(0, 2**16),
    tile_rows=st.integers(1, 12),
)
def test_rectangular_random_masks(tq, tk, density, seed, tile_rows) -> None:
    """Random tables of any shape (rows * keys rarely a multiple of 8, runs crossing row ends)."""
    table = torch.rand(tq, tk, generator=torch.Generator().manual_seed(seed)) < density
    old = mm._CPU_TILE_ELEMENTS
    mm._CPU_TILE_ELEMENTS = tile_rows * tk
    try:
        q, k, t = infer_attn_mask_from_mask_mod(lambda b, h, qi, ki: table[qi, ki], tq, tk)
    finally:
        mm._CPU_TILE_ELEMENTS = old
    assert torch.equal(_union(q, k, t, tq, tk), table)


def test_cross_shapes_and_empty_rows() -> None:
    def fn(b, h, q, k):
        return (k >= 2 * q) & (k < 2 * q + 5) & (q % 3 != 1)

    q, k, t = infer_attn_mask_from_mask_mod(fn, 20, 50)
    assert torch.equal(_union(q, k, t, 20, 50), _dense(fn, 20, 50))


@pytest.mark.parametrize(
    ("name", "param", "per_doc"),
    [
        ("doc_causal", 0, [AttnMaskType.CAUSAL]),
        ("doc_full", 0, [AttnMaskType.FULL]),
        ("window", 8, [AttnMaskType.CAUSAL, AttnMaskType.BI_CAUSAL]),
        ("prefix_lm", 5, [AttnMaskType.FULL, AttnMaskType.CAUSAL]),
    ],
)
def test_structured_masks_are_compact(name: str, param: int, per_doc: list[AttnMaskType]) -> None:
    lengths = [30, 57, 41, 64]
    fn = _family(name, _doc_ids(lengths), param, None)
    q, k, t = infer_attn_mask_from_mask_mod(fn, sum(lengths), sum(lengths))
    assert list(t) == per_doc * len(lengths)
    assert torch.equal(_union(q, k, t, sum(lengths), sum(lengths)), _dense(fn, sum(lengths), sum(lengths)))


def test_head_or_batch_dependent_masks_are_rejected() -> None:
    with pytest.raises(ValueError, match="batch or head"):
        infer_attn_mask_from_mask_mod(lambda b, h, q, k: (q >= k) & (h == 0), 16, 16)
    with pytest.raises(ValueError, match="batch or head"):
        infer_attn_mask_from_mask_mod(lambda b, h, q, k: (q >= k) ^ (b != h), 16, 16)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("not callable", 4, 4), TypeError, "callable"),
        ((lambda b, h, q, k: q - k, 4, 4), TypeError, "bool"),
        ((lambda b, h, q, k: torch.ones(3, dtype=torch.bool), 4, 4), ValueError, "broadcast"),
        ((lambda b, h, q, k: q >= k, 0, 4), ValueError, "total_seqlen_q"),
        ((lambda b, h, q, k: q >= k, 4, 2.5), ValueError, "total_seqlen_k"),
    ],
)
def test_bad_input(args, error, match) -> None:
    with pytest.raises(error, match=match):
        infer_attn_mask_from_mask_mod(*args)


def test_inferred_slices_drive_calc_attn() -> None:
    """The result goes straight into a key; attention equals dense fp64 attention on the mask_mod."""
    lengths = [11, 25, 8]
    total = sum(lengths)
    fn = _family("window", _doc_ids(lengths), 6, None)
    q_ranges, k_ranges, types = infer_attn_mask_from_mask_mod(fn, total, total)
    key = magi_attn_flex_key(q_ranges, k_ranges, types, total, total, 2, 1, 8, None)
    gen = torch.Generator().manual_seed(random.Random(1).randrange(100))
    q, k, v = (torch.randn(total, h, 8, dtype=torch.float64, generator=gen) for h in (2, 1, 1))
    out, _ = calc_attn(q, k, v, key)
    ref, _ = ref_attn(q, k, v, _dense(fn, total, total))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


# -- the vectorised fold against a plain row-by-row one ------------------------------------------------
_SLOPES = {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}  # slope code, as in mm._TYPES


@dataclass
class _RefRun:
    first_row: int
    last_row: int
    start0: int
    end0: int
    last_start: int
    last_end: int
    slopes: tuple[int, int] | None = None


def _ref_fold(rows: list[list[tuple[int, int]]]) -> list[tuple[int, int, int, int, int]]:
    """The greedy rule, one row at a time: a row extends the open runs when it has as many intervals and
    each (start, end) steps by (0|1, 0|1), equal to the run's slopes once the run has two rows."""
    active: list[_RefRun] = []
    out: list[tuple[int, int, int, int, int]] = []

    def flush() -> None:
        for r in active:
            sl = r.slopes or (0, 0)
            k_end = r.last_end if sl[1] else r.end0
            out.append((r.first_row, r.last_row + 1, r.start0, k_end, _SLOPES[sl]))
        active.clear()

    for row, intervals in enumerate(rows):
        if active and len(intervals) == len(active):
            steps = [(s - r.last_start, e - r.last_end) for r, (s, e) in zip(active, intervals)]
            if all(st in _SLOPES and r.slopes in (None, st) for r, st in zip(active, steps)):
                for r, (s, e), st in zip(active, intervals, steps):
                    r.last_row, r.last_start, r.last_end, r.slopes = row, s, e, st
                continue
        flush()
        active.extend(_RefRun(row, row, s, e, s, e) for s, e in intervals)
    flush()
    return out


_STEPS = [(0, 0), (0, 1), (1, 0), (1, 1), (-1, 0), (0, 2), (1, -1), (3, 3)]
_ROW = st.one_of(
    st.just(("empty",)),
    st.just(("repeat",)),  # the previous row's steps again: long runs
    st.tuples(st.just("fresh"), st.lists(st.integers(1, 4), min_size=2, max_size=6)),
    st.tuples(st.just("step"), st.lists(st.sampled_from(_STEPS), min_size=3, max_size=3)),
)


def _rows_from(ops) -> list[list[tuple[int, int]]]:
    rows: list[list[tuple[int, int]]] = []
    prev: list[tuple[int, int]] = []
    steps = [(0, 0)] * 3
    for op in ops:
        if op[0] == "empty":
            cur = []
        elif op[0] == "fresh" or not prev:
            gaps = op[1] if op[0] == "fresh" else [1, 2]
            cur, at = [], 0
            for a, b in zip(gaps[0::2], gaps[1::2]):
                cur.append((at + a, at + a + b))
                at += a + b
        else:
            if op[0] == "step":
                steps = op[1]
            cur = [(s + ds, e + de) for (s, e), (ds, de) in zip(prev, steps * len(prev))]
        rows.append(cur)
        prev = cur
    return rows


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_ROW, max_size=60), cuts=st.lists(st.integers(0, 60), max_size=6))
def test_fold_matches_row_by_row(ops, cuts) -> None:
    """Same slices, in the same order, however the rows are split into batches."""
    rows = _rows_from(ops)
    folder = mm._Folder()
    bounds = sorted({0, len(rows), *(c for c in cuts if c <= len(rows))})
    for a, b in itertools.pairwise(bounds):
        batch = rows[a:b]
        flat = [iv for r in batch for iv in r]
        folder.add(
            np.array([len(r) for r in batch], dtype=np.int64),
            np.array([s for s, _ in flat], dtype=np.int64),
            np.array([e for _, e in flat], dtype=np.int64),
        )
    got = [tuple(c) for c in folder.finish().T.tolist()]
    assert got == _ref_fold(rows)


def test_fold_long_runs_and_alternating_steps() -> None:
    """A run over many batches; then steps alternating every row (pairs of rows), then a lone row."""
    rows = [[(0, 5 + i)] for i in range(100)]
    rows += [[(200 + i // 2 + (i % 2), 300)] for i in range(9)]
    rows += [[], [(7, 9)]]
    for cut in (1, 7, 50, len(rows)):
        folder = mm._Folder()
        for a in range(0, len(rows), cut):
            batch = rows[a : a + cut]
            folder.add(
                np.array([len(r) for r in batch]),
                np.array([iv[0] for r in batch for iv in r], dtype=np.int64),
                np.array([iv[1] for r in batch for iv in r], dtype=np.int64),
            )
        got = [tuple(c) for c in folder.finish().T.tolist()]
        assert got == _ref_fold(rows)
        assert got[0] == (0, 100, 0, 104, 1)  # one CAUSAL slice for the first 100 rows


# -- tile edge cases: shapes, broadcasting, word alignment ----------------------------------------------
@pytest.mark.parametrize(
    ("fn", "tq", "tk"),
    [
        (lambda b, h, q, k: q >= k, 1, 1),
        (lambda b, h, q, k: q % 3 == 0, 9, 1),  # one key
        (lambda b, h, q, k: q % 3 != 1, 13, 11),  # [rows, 1]: a broadcast view, not contiguous
        (lambda b, h, q, k: k % 4 < 2, 7, 29),  # [1, keys]
        (lambda b, h, q, k: torch.tensor(True), 5, 3),  # 0-d
        (lambda b, h, q, k: (q + k) % 5 == 0, 17, 19),  # rows * (keys - 1) not a multiple of 8
    ],
)
@pytest.mark.parametrize("tile_rows", [1, 3, 100])
def test_tile_shapes(fn, tq: int, tk: int, tile_rows: int, monkeypatch) -> None:
    monkeypatch.setattr(mm, "_CPU_TILE_ELEMENTS", tile_rows * tk)
    q, k, t = infer_attn_mask_from_mask_mod(fn, tq, tk)
    assert torch.equal(_union(q, k, t, tq, tk), _dense(fn, tq, tk))


def test_head_dependence_found_in_a_later_tile(monkeypatch) -> None:
    """Every tile is checked, including broadcast (non-contiguous) results, which skip the word compare."""
    monkeypatch.setattr(mm, "_CPU_TILE_ELEMENTS", 4 * 16)
    with pytest.raises(ValueError, match=r"rows 12..15 differ between b, h = 0, 0 and 1, 1"):
        infer_attn_mask_from_mask_mod(lambda b, h, q, k: (q >= k) & ((q < 12) | (h == 0)), 16, 16)
    with pytest.raises(ValueError, match=r"rows 8..11 differ"):
        infer_attn_mask_from_mask_mod(lambda b, h, q, k: (q < 8) | (b == 0), 16, 16)  # [rows, 1]


# -- the compiled pass (GPU default; forced on the CPU here, through inductor's C++ backend) ----------------
class _CompiledCalls(list):
    """Per call of the compiled pass: whether it ran (True) or fell back (False); ``kernels``: which kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: list[str] = []


@pytest.fixture
def compiled_pass(monkeypatch):
    """Force the compiled pass on the CPU and record, per call, whether it ran (True) or fell back (False)."""
    monkeypatch.setattr(mm, "_use_compiled_pass", lambda device: True)
    monkeypatch.setattr(mm, "_COMPILED_MIN_ELEMENTS", 0)
    ran = _CompiledCalls()
    inner = mm._compiled_run_stats

    def spy(*args, **kwargs):
        out = inner(*args, **kwargs)
        ran.append(out is not None)
        ran.kernels.append("two runs" if args[-1] else "one run")
        return out

    monkeypatch.setattr(mm, "_compiled_run_stats", spy)
    return ran


@pytest.mark.parametrize("name", ["doc_causal", "window", "prefix_lm"])
def test_compiled_pass_equals_marking_pass(name: str, compiled_pass, monkeypatch) -> None:
    """Tiles of 40 rows (the last one short): one compiled kernel per tile gives the same slices."""
    lengths = [90, 1, 133, 64, 57]
    total = sum(lengths)
    fn = _family(name, _doc_ids(lengths), 9, None)
    want = infer_attn_mask_from_mask_mod(fn, total, total)  # one tile: the marking pass only
    monkeypatch.setattr(mm, "_CPU_TILE_ELEMENTS", 40 * total)
    got = infer_attn_mask_from_mask_mod(fn, total, total)
    assert compiled_pass == [True]
    assert got == want
    assert torch.equal(_union(*got, total, total), _dense(fn, total, total))


def test_compiled_pass_hands_multi_run_tiles_to_the_marking_pass(compiled_pass, monkeypatch) -> None:
    """Rows 150.. see two runs each; the first tiles are one-run: the compiled pass folds those, the
    marking pass the rest, and the union is still exact (including a rectangular shape)."""
    tq, tk = 230, 170

    def fn(b, h, q, k):
        return (k <= q) | ((q >= 150) & (k >= q - 100) & (k % 7 < 3))

    monkeypatch.setattr(mm, "_CPU_TILE_ELEMENTS", 32 * tk)
    q, k, t = infer_attn_mask_from_mask_mod(fn, tq, tk)
    assert compiled_pass == [True]
    assert torch.equal(_union(q, k, t, tq, tk), _dense(fn, tq, tk))


@pytest.mark.parametrize("sinks", [1, 4])
def test_compiled_pass_resolves_two_runs(sinks: int, compiled_pass, monkeypatch) -> None:
    """Sink tokens + a causal window within documents: rows of two runs take the two-run kernel; rows of
    three (a document's sinks, the first document's sinks, the window) still go to the marking pass."""
    lengths = [120, 9, 200, 71]
    total = sum(lengths)
    doc = _doc_ids(lengths)

    def sink_window(b, h, q, k):
        return (k < sinks) | ((doc[q] == doc[k]) & (q >= k) & (q - k < 16))

    def doc_sinks_window(b, h, q, k):  # rows past the first document: global sinks, doc start, window
        start = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)[doc]
        return sink_window(b, h, q, k) | ((doc[q] == doc[k]) & (k - start[k] < 2) & (k <= q))

    monkeypatch.setattr(mm, "_CPU_TILE_ELEMENTS", 48 * total)
    for fn in (sink_window, doc_sinks_window):
        q, k, t = infer_attn_mask_from_mask_mod(fn, total, total)
        assert torch.equal(_union(q, k, t, total, total), _dense(fn, total, total))
    assert compiled_pass == [True, True]
    assert compiled_pass.kernels == ["two runs", "two runs"]


def test_compiled_pass_never_recompiles_per_tile(compiled_pass, monkeypatch) -> None:
    """A mask_mod that mutates Python state changes dynamo's guards on every tile: instead of recompiling
    tile after tile (or raising dynamo's errors), the call falls back to the marking pass; the next call
    with the same mask_mod and size goes there straight away."""
    monkeypatch.setattr(mm, "_CPU_TILE_ELEMENTS", 16 * 256)
    calls = [0]

    def counting(b, h, q, k):
        calls[0] += 1
        return q >= k

    want = infer_attn_mask_from_mask_mod(lambda b, h, q, k: q >= k, 256, 256)
    assert infer_attn_mask_from_mask_mod(counting, 256, 256) == want
    before = calls[0]
    assert infer_attn_mask_from_mask_mod(counting, 256, 256) == want
    assert compiled_pass == [True, False, False]
    assert calls[0] - before == 16 * 2 + 1  # marking pass only: 2 evaluations a tile, the first tile 3


def test_small_masks_take_the_marking_pass(compiled_pass, monkeypatch) -> None:
    """Under the size threshold nothing compiles; at the threshold the same mask_mod takes the compiled pass,
    and so does a second mask_mod of the same code and size with other tensors in its closure (exactly)."""
    monkeypatch.setattr(mm, "_CPU_TILE_ELEMENTS", 32 * 200)
    monkeypatch.setattr(mm, "_COMPILED_MIN_ELEMENTS", 200 * 200 + 1)

    def doc_causal(doc):
        return lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k)

    first = doc_causal(_doc_ids([50, 150]))
    infer_attn_mask_from_mask_mod(first, 200, 200)
    assert compiled_pass == []
    monkeypatch.setattr(mm, "_COMPILED_MIN_ELEMENTS", 200 * 200)
    infer_attn_mask_from_mask_mod(first, 200, 200)
    second = doc_causal(_doc_ids([120, 3, 77]))
    got = infer_attn_mask_from_mask_mod(second, 200, 200)
    assert compiled_pass == [True, True]
    assert torch.equal(_union(*got, 200, 200), _dense(second, 200, 200))


def test_compiled_pass_finds_head_dependence_and_falls_back(compiled_pass, monkeypatch) -> None:
    monkeypatch.setattr(mm, "_CPU_TILE_ELEMENTS", 8 * 64)
    with pytest.raises(ValueError, match=r"rows 40..47 differ between b, h = 0, 0 and 1, 1"):
        infer_attn_mask_from_mask_mod(lambda b, h, q, k: (q >= k) & ((q < 41) | (h == 0)), 64, 64)
    assert compiled_pass == [True]

    def untraceable(b, h, q, k):  # data-dependent Python control flow: dynamo cannot capture it whole
        return q >= k if bool((q[0] % 2 == 0).all()) else q > k

    got = infer_attn_mask_from_mask_mod(untraceable, 64, 64)
    assert compiled_pass == [True, False]
    assert got == infer_attn_mask_from_mask_mod(lambda b, h, q, k: q >= k, 64, 64)


def test_compiled_pass_runs_on_gpus_unless_turned_off(monkeypatch) -> None:
    monkeypatch.delenv("MAGI_ATTENTION_MASK_MOD_COMPILE", raising=False)
    assert mm._use_compiled_pass(torch.device("cuda", 0))
    assert not mm._use_compiled_pass(torch.device("cpu"))
    monkeypatch.setenv("MAGI_ATTENTION_MASK_MOD_COMPILE", "0")
    assert not mm._use_compiled_pass(torch.device("cuda", 0))


# -- the same on a GPU (skipped without one) -----------------------------------------------------------
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("tile_rows", [5, None])
def test_cuda_equals_cpu(name: str, tile_rows: int | None, monkeypatch) -> None:
    lengths = [300, 1, 517, 64, 1000, 167]
    total = sum(lengths)
    table = torch.rand(total, total, generator=torch.Generator().manual_seed(3)) < 0.3

    def on(device: str):
        doc = _doc_ids(lengths).to(device)
        return _family(name, doc, 37, table.to(device))

    if tile_rows is not None:
        monkeypatch.setattr(mm, "_GPU_TILE_ELEMENTS", tile_rows * total)
    got = infer_attn_mask_from_mask_mod(on("cuda"), total, total, device="cuda")
    assert got == infer_attn_mask_from_mask_mod(on("cpu"), total, total)
    assert torch.equal(_union(*got, total, total), _dense(on("cpu"), total, total))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_takes_the_compiled_pass(compiled_pass, monkeypatch) -> None:
    """On a GPU the compiled pass runs by default (inductor's Triton kernels; here without the size
    threshold) and equals the CPU result."""
    monkeypatch.setattr(mm, "_use_compiled_pass", lambda device: device.type == "cuda")
    lengths = [3000, 17, 5000, 1983]
    total = sum(lengths)
    monkeypatch.setattr(mm, "_GPU_TILE_ELEMENTS", 64 * total)
    got = infer_attn_mask_from_mask_mod(
        _family("prefix_lm", _doc_ids(lengths).cuda(), 100, None), total, total, device="cuda"
    )
    assert compiled_pass == [True]
    assert got == infer_attn_mask_from_mask_mod(
        _family("prefix_lm", _doc_ids(lengths), 100, None), total, total
    )
