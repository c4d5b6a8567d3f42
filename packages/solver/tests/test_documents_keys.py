"""The documents placement's received keys: cut units' short pieces first, long units' pieces from the end."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from magi_solver import make_family_mask, make_varlen_causal_mask
from magi_solver.documents import documents_plans
from magi_solver.documents_orient import oriented
from magi_solver.kernel_law import get_kernel_law, law_for_mask
from magi_solver.mask import normalize_mask
from magi_solver.pricing import price_plan, remote_kv_tokens

LAW = get_kernel_law("h200", "cudnn")


def _family(name: str, total: int, seed: int) -> list:
    spec = make_family_mask(name, total, seed)
    q = [list(r) for r in spec.q_ranges.to_tuples()]
    k = [list(r) for r in spec.k_ranges.to_tuples()]
    return normalize_mask(q, k, [t.code for t in spec.types], total, total)


def _received(owner: np.ndarray, sl: list, c: int, cp: int) -> int:
    from magi_solver.dispatch import _key_intervals

    chunk, _, kl, kr = _key_intervals(sl, c)
    return int(remote_kv_tokens(owner, chunk, kl, kr, c, cp).sum())


def test_a_straddling_units_short_piece_goes_first() -> None:
    # two causal documents of 10 chunks; rank 1 holds the first one's last chunk and the whole second:
    # its one chunk needs the 9 before it. Reordered, rank 1 holds the first chunk (needs nothing) and
    # rank 0 chunks 1-9 (needs one chunk of keys)
    c, cp = 128, 2
    total = 20 * c
    sl = normalize_mask(*make_varlen_causal_mask([0, 10 * c, total]), total, total)
    units = np.asarray([0, 10, 20], dtype=np.int64)
    owner = np.asarray([0] * 9 + [1] + [1] * 10, dtype=np.int64)
    got = oriented(owner, units, cp)
    assert got.tolist() == [1] + [0] * 9 + [1] * 10
    assert np.array_equal(np.bincount(got, minlength=cp), np.bincount(owner, minlength=cp))
    assert _received(owner, sl, c, cp) == 9 * c
    assert _received(got, sl, c, cp) == c
    assert np.array_equal(owner, [0] * 9 + [1] * 11)  # the input is left as it was


def test_orientation_keeps_counts_and_leaves_whole_and_skipped_units() -> None:
    rng = np.random.default_rng(3)
    cp = 4
    units = np.asarray([0, 5, 12, 30, 31, 40], dtype=np.int64)
    owner = rng.integers(0, cp, size=40).astype(np.int64)
    owner[30] = 2  # a one-chunk unit: one holder
    skip = np.asarray([False, True, False, False, False])
    got = oriented(owner, units, cp, cp, skip)
    for u, (a, b) in enumerate(itertools.pairwise(units.tolist())):
        assert np.array_equal(np.bincount(got[a:b], minlength=cp), np.bincount(owner[a:b], minlength=cp))
        if skip[u] or b - a == 1:
            assert np.array_equal(got[a:b], owner[a:b])
            continue
        runs = np.flatnonzero(np.diff(got[a:b])) + 1  # contiguous runs, fewer chunks first
        sizes = np.diff(np.r_[0, runs, b - a])
        assert len(sizes) == len(set(owner[a:b].tolist()))
        assert sizes.tolist() == sorted(sizes.tolist())
    # `most`: a unit held by more ranks is left alone
    two = oriented(owner, units, cp, 2)
    for a, b in itertools.pairwise(units.tolist()):
        if len(set(owner[a:b].tolist())) > 2:
            assert np.array_equal(two[a:b], owner[a:b])


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0])
def test_pieces_from_the_end_cut_as_early_as_the_forward_pieces_allow(scale: float) -> None:
    # the same test per piece, sized from the unit's end: no more pieces, every cut at or before the
    # forward pass's (a cut at chunk p costs the later piece's rank p chunks of keys)
    from magi_solver.documents_fills import _pieces, _time_pieces, _time_pieces_back
    from magi_solver.documents_units import _chunk_tables, _Costs

    total, c = 16384, 128
    sl = normalize_mask([[0, total]], [[0, total]], "causal", total, total)
    n = total // c
    area, klo, khi, _ = _chunk_tables(sl, n, c)
    costs = _Costs(area, klo, khi, c, LAW)
    whole = costs.range_cost(0, n)
    for room in (16, 48):
        tau = scale * whole * room / n
        filler = 0.3 * tau / room
        fwd = _time_pieces(costs, 0, n, room, tau, filler)
        back = _time_pieces_back(costs, 0, n, room, tau, filler)
        if back is None:
            assert _pieces(costs, 0, n, room, tau, filler, True) == fwd
            continue
        assert back[0][0] == 0 and back[-1][1] == n
        assert all(x[1] == y[0] for x, y in itertools.pairwise(back))
        assert len(back) <= len(fwd)
        if len(back) == len(fwd):
            assert all(b[0] <= f[0] for b, f in zip(back, fwd))
        for x, y in back:  # every piece passes the rank's test
            assert y - x <= room
            assert costs.range_cost(x, y) + (room - (y - x)) * filler <= tau * (1 + 1e-12)


def test_received_keys_of_a_seeded_docs_mask() -> None:
    # log-normal causal documents (median 4,096), 8k tokens per rank at cp 8: the long document's pieces
    # sized from its end (and as if their ranks' fillers were thinner) receive 16 % fewer keys than pieces
    # sized from its start at the fillers' mean density (103,237)
    total, cp = 65536, 8
    sl = _family("docs4k_causal", total, seed=0)
    law = law_for_mask(sl, total)
    plan = documents_plans(sl, total, cp, law)[0]
    assert int(price_plan(plan, sl, law).remote.sum()) <= 90_000


@pytest.mark.parametrize(
    ("name", "cp"), [("docs4k_causal", 8), ("short_docs_causal", 8), ("docs4k_window2048", 16)]
)
def test_fewer_keys_never_worsen_the_pick(name: str, cp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the fewer-keys layouts replace the pick only where its step, kernel metric and busiest K/V are no
    # worse and its time imbalance at most 0.01 worse (the pick before the polish, which runs on either)
    import magi_solver.documents as documents

    monkeypatch.setattr(documents, "_POLISH", False)
    total = 2048 * cp
    sl = _family(name, total, seed=0)
    law = law_for_mask(sl, total)

    def priced() -> tuple:
        plan = documents_plans(sl, total, cp, law)[0]
        p = price_plan(plan, sl, law)
        return p.step_ms, float(p.fwd_ms.max() + p.bwd_ms.max()), p.time_imbalance, int(p.remote.max())

    with_fewer = priced()
    monkeypatch.setattr(documents, "_FEWER_KEYS", False)
    without = priced()
    assert with_fewer[0] <= without[0] * (1 + 1e-9)
    assert with_fewer[1] <= without[1] * (1 + 1e-9)
    assert with_fewer[2] <= without[2] + 0.01 + 1e-9
    assert with_fewer[3] <= 1.1 * without[3]


@pytest.mark.parametrize(("name", "seed"), [("docs4k_causal", 1), ("short_docs_causal", 3)])
def test_unit_by_unit_orientation_slows_no_rank_and_receives_fewer(
    name: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the placement without its fewer-keys layouts and polish: some cut units' short pieces sit last
    import magi_solver.documents as documents
    from magi_solver.documents_orient import oriented_where_no_worse
    from magi_solver.documents_repair import ChunkTables, _State
    from magi_solver.documents_units import _chunk_tables, _Costs, find_units
    from magi_solver.pricing import NODE

    monkeypatch.setattr(documents, "_FEWER_KEYS", False)
    monkeypatch.setattr(documents, "_POLISH", False)
    cp = 16
    total = 4096 * cp
    sl = _family(name, total, seed=seed)
    law = law_for_mask(sl, total)
    plan = documents_plans(sl, total, cp, law)[0]
    c, n = plan.chunk_size, plan.num_chunks
    owner = np.asarray(plan.chunk_owner, dtype=np.int64)
    area, klo, khi, _ = _chunk_tables(sl, n, c)
    units = find_units(sl, _Costs(area, klo, khi, c, law), n)
    lo = np.minimum(klo, np.arange(n) * c)
    hi = np.maximum(khi, (np.arange(n) + 1) * c)
    tables = ChunkTables(area, lo, hi, units, c, cp, law, NODE)
    got = oriented_where_no_worse(owner, tables)
    for a, b in itertools.pairwise(units.tolist()):
        assert np.array_equal(np.bincount(got[a:b], minlength=cp), np.bincount(owner[a:b], minlength=cp))
    before, after = _State(owner.copy(), tables).metric(), _State(got.copy(), tables).metric()
    assert after[0] <= before[0] * (1 + 1e-12) and after[1] <= before[1] * (1 + 1e-12)
    assert _received(got, sl, c, cp) < _received(owner, sl, c, cp)
