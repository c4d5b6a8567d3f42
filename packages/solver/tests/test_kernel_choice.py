"""The features `kernel_backend="auto"` keys its table by, the shipped table, and the pick (no torch)."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from magi_solver.cli import lognormal_doc_lens
from magi_solver.dispatch import solve_dispatch
from magi_solver.kernel_choice import (
    SPLIT_GAIN,
    KernelTable,
    MaskFeatures,
    _in_kernel_keys,
    busiest_rank_features,
    load_kernel_table,
    mask_features,
    pick_kernel,
)
from magi_solver.mask import AttnSlice, SliceList, normalize_mask


def test_features_of_common_masks() -> None:
    full = mask_features([(0, 1024, 0, 1024, 0)], 1024)
    assert full == MaskFeatures(1024, 1024 * 1024, 1.0, 1.0, True)
    causal = mask_features([(0, 1024, 0, 1024, 1)], 1024)
    assert causal.area == 1024 * 1025 // 2 and causal.documents
    # 8 x 8 tiles, the diagonal ones half full: fill = area / (36 tiles)
    assert causal.tile_fill == pytest.approx(causal.area / (36 * 128 * 128))
    docs = [(0, 300, 0, 300, 1), (300, 1000, 300, 1000, 1)]
    f = mask_features(docs, 1000)
    assert f.documents and f.slices_per_row == 1.0 and f.tile_fill < causal.tile_fill
    # nested key ranges (block-causal), two types, or a row in two slices: not documents
    assert not mask_features([(0, 100, 0, 100, 0), (100, 200, 0, 200, 0)], 200).documents
    assert not mask_features([(0, 100, 0, 100, 0), (100, 200, 100, 200, 1)], 200).documents
    two = mask_features([(0, 100, 0, 50, 0), (0, 100, 60, 100, 0)], 100)
    assert two.slices_per_row == 2.0 and not two.documents
    # empty slices and uncovered rows count nothing
    assert mask_features([(0, 0, 0, 10, 0), (5, 10, 0, 10, 0)], 20).slices_per_row == 1.0


def test_busiest_rank_is_the_same_whatever_the_row_order() -> None:
    q, k, t = [[0, 4096]], [[0, 4096]], [1]
    perm = np.arange(4096).reshape(8, 512)
    ranks = [np.concatenate([perm[i], perm[7 - i]]) for i in range(4)]  # causal zigzag: balanced
    f = busiest_rank_features(q, k, t, ranks)
    shuffled = [np.random.default_rng(i).permutation(r) for i, r in enumerate(ranks)]
    assert busiest_rank_features(q, k, t, shuffled) == f
    assert f.tokens == 1024 and not f.documents  # a rank's two chunks see overlapping key prefixes
    # the rank with the most area wins: the last chunks of a causal mask
    plain = [perm[2 * i : 2 * i + 2].reshape(-1) for i in range(4)]
    g = busiest_rank_features(q, k, t, plain)
    assert g.area == sum(r + 1 for r in range(3072, 4096))
    # padding rows (ids past the mask) add tokens, not area
    pad = busiest_rank_features([[0, 100]], [[0, 100]], [0], [np.arange(0, 60), np.arange(60, 120)])
    assert pad.area == 60 * 100 and pad.tokens == 60


def test_a_document_split_over_two_ranks_in_the_kernels_key_coordinates() -> None:
    """Two ranks of 256 tokens; a causal document [0, 384) crosses the rank boundary, a second one [384, 512)
    stays on rank 1. Rank 1 (the busiest) holds keys [256, 512) at kernel positions [0, 256) and receives
    [0, 256) at [256, 512): its rows of the first document see every received key (FULL) and their own
    keys causally (CAUSAL), two slices per row."""
    q = k = [[0, 384], [384, 512]]
    halves = [np.arange(0, 256), np.arange(256, 512)]
    f = busiest_rank_features(q, k, [1, 1], halves, rank_keys=halves)
    # slices: (q 0-128, k 0-128, CAUSAL), (q 0-128, k 256-512, FULL), (q 128-256, k 128-256, CAUSAL)
    area = 128 * 129 // 2 + 128 * 256 + 128 * 129 // 2
    # 128-row block 0 touches key tiles 0, 2 and 3, block 1 tile 1
    assert f == MaskFeatures(256, area, area / (4 * 128 * 128), 1.5, False)
    # in global key coordinates the same rows are two packed documents (tiles 0-2 and tile 3)
    assert busiest_rank_features(q, k, [1, 1], halves) == MaskFeatures(256, area, f.tile_fill, 1.0, True)


def test_a_full_mask_stays_one_document_whatever_the_dispatch() -> None:
    """cp 4, each rank two non-adjacent chunks (zigzag): a chunk's rows see the rank's own keys and the
    received ones as several FULL pieces, which touch again in the kernel's coordinates: one slice per row."""
    chunks = np.arange(1024).reshape(8, 128)
    rows = [np.concatenate([chunks[r], chunks[7 - r]]) for r in range(4)]
    f = busiest_rank_features([[0, 1024]], [[0, 1024]], [0], rows, rank_keys=rows)
    assert f == MaskFeatures(256, 256 * 1024, 1.0, 1.0, True)


def test_rank_features_do_not_depend_on_the_order_of_ids() -> None:
    """Row and key ids come in dispatched order, which differs between callers: the features do not."""
    docs = [[0, 300], [300, 700], [700, 1024]]
    chunks = np.arange(1024).reshape(8, 128)
    rows = [np.concatenate([chunks[r], chunks[7 - r]]) for r in range(4)]
    f = busiest_rank_features(docs, docs, [1, 1, 1], rows, rank_keys=rows)
    rng = np.random.default_rng(0)
    shuffled = [rng.permutation(r) for r in rows]
    shuffled_keys = [rng.permutation(r) for r in rows]
    assert busiest_rank_features(docs, docs, [1, 1, 1], shuffled, rank_keys=shuffled_keys) == f
    assert not f.documents and f.slices_per_row > 1.0
    # one rank holding every key in global order: the global mask, as without rank_keys
    whole = [np.arange(1024)]
    assert busiest_rank_features(docs, docs, [1, 1, 1], whole, rank_keys=whole) == busiest_rank_features(
        docs, docs, [1, 1, 1], whole
    )
    with pytest.raises(ValueError, match="rank_keys has 1 ranks, rank_rows 4"):
        busiest_rank_features(docs, docs, [1, 1, 1], rows, rank_keys=whole)


@pytest.mark.parametrize("seed", range(6))
def test_kernel_key_slices_are_the_ranks_mask_reordered(seed: int) -> None:
    """Densely: a rank's slices moved to the kernel's key coordinates cover exactly its rows of the mask with
    the key columns reordered (own keys sorted, then the others by global id), each pair once."""
    rng = np.random.default_rng(seed)
    total, chunk, cp = 96, 8, 3
    raw = []
    for _ in range(5):
        qs, ks = (int(x) for x in rng.integers(0, total - 8, 2))
        raw.append((qs, int(rng.integers(qs + 1, total + 1)), ks, int(rng.integers(ks + 1, total + 1))))
    types = [int(x) for x in rng.integers(0, 4, len(raw))]
    mask = normalize_mask([r[:2] for r in raw], [r[2:] for r in raw], types, total, total)
    padded = total + 4  # key ids past the mask: padding a rank holds or receives
    dense = SliceList.from_typed(mask).to_dense(total, padded) > 0
    owner = rng.permutation(np.repeat(np.arange(cp), total // chunk // cp))
    for rank in range(cp):
        rows = np.flatnonzero(np.repeat(owner == rank, chunk))
        keys = np.concatenate([rows, [total + rank]])
        local = []  # the rank's query rows in local order against global keys
        for l0, run in enumerate(rows.reshape(-1, chunk)):
            g0, g1 = int(run[0]), int(run[-1]) + 1
            for qs, qe, ks, ke, t in mask:
                for part in AttnSlice((qs, qe), (ks, ke), t).clip_q(g0, g1) if qs < g1 and qe > g0 else []:
                    off = l0 * chunk - g0
                    local.append((part.q_range.start + off, part.q_range.end + off, part.k_range.start,
                                  part.k_range.end, part.mask_type.code))  # fmt: skip
        moved = _in_kernel_keys(local, np.sort(keys))
        columns = np.concatenate([np.sort(keys), np.setdiff1d(np.arange(padded), keys)])
        want = dense[np.ix_(rows, columns)]
        got = SliceList.from_typed(moved).to_dense(rows.size, padded)
        assert got.max(initial=0) <= 1 and np.array_equal(got > 0, want)


def test_a_million_token_mask_at_cp_64_takes_a_few_seconds_at_most() -> None:
    """Every rank computes the features once per key: 1M tokens of 3000 log-normal documents at cp 64 (the
    slowest mask measured, 0.2-0.3 s on one CPU core) must not grow past a few seconds."""
    total, cp, chunk = 1 << 20, 64, 2048
    bounds = [0, *itertools.accumulate(lognormal_doc_lens(total, 3000, 0))]
    docs = [list(p) for p in itertools.pairwise(bounds)]
    dispatch = solve_dispatch(docs, docs, [1] * len(docs), total, cp, chunk)
    rows = [dispatch.position_ids(r) for r in range(cp)]
    start = time.perf_counter()
    f = busiest_rank_features(docs, docs, [1] * len(docs), rows, rank_keys=rows)
    assert time.perf_counter() - start < 5.0
    assert f.tokens == total // cp and not f.documents


def test_shipped_table_loads_and_unknown_kinds_have_none() -> None:
    table = load_kernel_table("h200")
    assert table is not None and table.gpu_kind == "h200" and len(table.rows) >= 10
    assert {b for r in table.rows for b in r["ms"]} >= {"fa4", "cudnn"}
    assert load_kernel_table("b200") is None
    # Hopper kinds without a table of their own read the H200's (the same kernels and tiles)
    for kind in ("h100", "h800"):
        hopper = load_kernel_table(kind)
        assert hopper is not None and hopper.gpu_kind == "h200" and hopper.rows == table.rows
    with pytest.raises(ValueError, match="lacks"):
        KernelTable.from_dict({"gpu_kind": "x", "rows": [{"mask": "full", "tokens": 1}]})


def _table(rows) -> KernelTable:
    return KernelTable.from_dict(json.loads(json.dumps({"gpu_kind": "test", "rows": rows})))


ROWS = [
    {"mask": "docs", "tokens": 8192, "head_dim": 128, "tile_fill": 0.7, "slices_per_row": 1.0, "documents": True,
     "ms": {"fa4": [1.0, 2.0], "cudnn": [1.5, 3.0]}},
    {"mask": "frag", "tokens": 8192, "head_dim": 128, "tile_fill": 0.8, "slices_per_row": 4.0, "documents": False,
     "ms": {"fa4": [1.0, 4.0], "cudnn": [1.0, 3.0]}},
    {"mask": "big", "tokens": 32768, "head_dim": 128, "tile_fill": 0.9, "slices_per_row": 1.0, "documents": False,
     "ms": {"cudnn": [9.0, 20.0]}},
]  # fmt: skip


def test_pick_takes_the_nearest_row_and_the_fastest_candidate() -> None:
    t = _table(ROWS)
    docs = MaskFeatures(9000, 1, 0.72, 1.0, True)
    assert pick_kernel(t, docs, 128, ["fa4", "cudnn"]).forward == "fa4"
    frag = MaskFeatures(8000, 1, 0.75, 3.0, False)
    pick = pick_kernel(t, frag, 128, ["fa4", "cudnn"])
    assert (pick.forward, pick.backward) == ("cudnn", "cudnn")
    assert "frag" in pick.reason and "fa4 1.000 / 4.000" in pick.reason
    # only the candidates every rank can run; a row that measured none of them: no pick
    assert pick_kernel(t, frag, 128, ["fa4"]).backward == "fa4"
    assert pick_kernel(t, MaskFeatures(32768, 1, 0.9, 1.0, False), 128, ["fa4"]) is None
    # no row for the head_dim, or no table: no pick (the caller keeps its rule)
    assert pick_kernel(t, docs, 256, ["fa4", "cudnn"]) is None
    assert pick_kernel(None, docs, 128, ["fa4"]) is None
    # ties are broken by name, so every rank agrees
    tie = _table([{**ROWS[0], "ms": {"fa4": [1.0, 1.0], "cudnn": [1.0, 1.0]}}])
    assert pick_kernel(tie, docs, 128, ["fa4", "cudnn"]).forward == "cudnn"


def test_pick_splits_directions_only_for_a_clear_gain() -> None:
    docs = MaskFeatures(9000, 1, 0.72, 1.0, True)
    # fa4 wins the total (1.0 + 3.0 < 1.5 + 2.9) but cudnn's backward is not 5 % faster: one backend
    near = _table([{**ROWS[0], "ms": {"fa4": [1.0, 3.0], "cudnn": [1.5, 2.9]}}])
    pick = pick_kernel(near, docs, 128, ["fa4", "cudnn"])
    assert (pick.forward, pick.backward) == ("fa4", "fa4")
    # cudnn's backward 10 % faster, fa4's forward 40 % faster: each direction on its own fastest backend
    split = _table([{**ROWS[0], "ms": {"fa4": [1.0, 3.0], "cudnn": [1.7, 2.7]}}])
    pick = pick_kernel(split, docs, 128, ["fa4", "cudnn"])
    assert (pick.forward, pick.backward) == ("fa4", "cudnn")
    assert "fa4 forward, cudnn backward" in pick.reason
    # without cudnn among the candidates (a rank cannot run it): no split
    pick = pick_kernel(split, docs, 128, ["fa4", "triton"])
    assert (pick.forward, pick.backward) == ("fa4", "fa4")


def test_deterministic_rows_are_used_only_in_deterministic_mode() -> None:
    docs = MaskFeatures(9000, 1, 0.72, 1.0, True)
    det_row = {**ROWS[0], "deterministic": True, "ms": {"fa4": [1.0, 9.0], "cudnn": [1.5, 3.5]}}
    t = _table([*ROWS, det_row])
    assert t.rows[0]["deterministic"] is False and t.rows[-1]["deterministic"] is True
    # default mode: the default rows only (fa4 fastest there)
    assert pick_kernel(t, docs, 128, ["fa4", "cudnn"]).forward == "fa4"
    # deterministic mode: the deterministic row (fa4's ordered backward is slow there)
    pick = pick_kernel(t, docs, 128, ["fa4", "cudnn"], deterministic=True)
    assert (pick.forward, pick.backward) == ("fa4", "cudnn") and "nearest deterministic" in pick.reason
    # no deterministic row for the head_dim: the default rows, and the reason says so
    pick = pick_kernel(_table(ROWS), docs, 128, ["fa4", "cudnn"], deterministic=True)
    assert pick.forward == "fa4" and "default-mode (no deterministic rows" in pick.reason
    with pytest.raises(ValueError, match="deterministic"):
        _table([{**ROWS[0], "deterministic": "yes"}])


def test_shipped_table_picks_what_it_measured() -> None:
    t = load_kernel_table("h200")
    for row in t.rows:
        f = MaskFeatures(row["tokens"], 1, row["tile_fill"], row["slices_per_row"], row["documents"])
        cands = ["fa4", "cudnn", "triton"]
        pick = pick_kernel(t, f, row["head_dim"], cands, deterministic=row["deterministic"])
        ms = {b: row["ms"][b] for b in cands if b in row["ms"]}
        # on its own row, each direction is within SPLIT_GAIN of that direction's fastest measured backend
        for i, got in enumerate((pick.forward, pick.backward)):
            fastest = min(v[i] for v in ms.values())
            assert ms[got][i] * (1 - SPLIT_GAIN) <= fastest, (row["mask"], row["tokens"], row["head_dim"], i)


def test_kernel_key_ids_per_attention_kind() -> None:
    """One rank: None (global order); self-attention: each rank's query tokens; cross-attention: each rank's
    contiguous key/value shard."""
    from magi_solver.kernel_choice import kernel_key_ids
    from magi_solver.kv_layout import KVLayout

    rows = [np.array([4, 5, 0, 1]), np.array([2, 3, 6, 7])]
    assert kernel_key_ids(rows[:1], None) is None
    assert [r.tolist() for r in kernel_key_ids(rows, None)] == [[4, 5, 0, 1], [2, 3, 6, 7]]
    shards = kernel_key_ids(rows, KVLayout(6, 2, 3))
    assert [r.tolist() for r in shards] == [[0, 1, 2], [3, 4, 5]]


def test_advise_kernel_asks_the_table_once_and_the_features_only_when_two_candidates_were_measured() -> None:
    """`advise_kernel`: the runtime's one question per key; the same pick as `pick_kernel` on the busiest
    rank's features of `RankProblems`, a reason where the capability rule stays, no features when there is
    nothing to pick between."""
    from magi_solver.kernel_choice import KernelAdvice, RankProblems, advise_kernel, kernel_key_ids
    from magi_solver.kv_layout import KVLayout

    docs = [[0, 900], [900, 2500], [2500, 4096]]
    rows = [np.arange(0, 2048), np.arange(2048, 4096)]
    problems = RankProblems(docs, docs, [1, 1, 1], rows)
    assert problems.features() == busiest_rank_features(docs, docs, [1, 1, 1], rows, rank_keys=rows)
    cross = RankProblems([[0, 4096]], [[0, 600]], [0], rows, KVLayout(600, 2, 300))
    keys = kernel_key_ids(rows, cross.kv_layout)
    assert cross.features() == busiest_rank_features([[0, 4096]], [[0, 600]], [0], rows, rank_keys=keys)

    def never() -> MaskFeatures:
        raise AssertionError("features computed")

    assert advise_kernel("h200", 128, (), never) == KernelAdvice(None)  # explicit, or no GPU: nothing to ask
    assert advise_kernel("h200", 128, ("fa4", "torch"), never) == KernelAdvice(None)  # one measured candidate
    unknown = advise_kernel("no-such-gpu", 128, ("cudnn", "fa4"), never)
    assert unknown.pick is None and "no measured kernel table for GPU kind 'no-such-gpu'" in unknown.reason
    no_row = advise_kernel("h200", 96, ("cudnn", "fa4"), problems)
    assert no_row.pick is None and "no row for head_dim 96" in no_row.reason
    advice = advise_kernel("h200", 128, ("cudnn", "fa4", "torch"), problems)
    assert advice.reason == "" and advice.pick == pick_kernel(
        load_kernel_table("h200"), problems.features(), 128, ["cudnn", "fa4"]
    )
    h100 = advise_kernel("h100", 128, ("cudnn", "fa4"), problems)  # the H200's table, said in the reason
    assert h100 == advice and "h200 table" in h100.pick.reason
    det = advise_kernel("h200", 128, ("cudnn", "triton"), problems, deterministic=True)
    assert det.pick == pick_kernel(
        load_kernel_table("h200"), problems.features(), 128, ["cudnn", "triton"], deterministic=True
    )
