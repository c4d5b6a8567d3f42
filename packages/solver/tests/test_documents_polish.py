"""The documents placement's balance polish (`magi_solver.documents_polish`)."""

from __future__ import annotations

import numpy as np
import pytest

from magi_solver import make_varlen_causal_mask
from magi_solver.cli import lognormal_doc_lens
from magi_solver.documents import _chunk_tables, _Costs, _exact_price, documents_plans, find_units
from magi_solver.documents_polish import _TAU, _lse, polish
from magi_solver.documents_repair import ChunkTables
from magi_solver.kernel_law import get_kernel_law, law_for_mask
from magi_solver.mask import normalize_mask
from magi_solver.pricing import price_plan

LAW = get_kernel_law("h200", "cudnn")


def _tables(total: int, cp: int, seed: int, c: int = 128) -> tuple:
    """A packed causal-document mask's chunk tables (`ChunkTables`) and its (slice, chunk) pieces."""
    cu = [0, *np.cumsum(lognormal_doc_lens(total, 3 * cp, seed)).tolist()]
    q, k, t = make_varlen_causal_mask(cu)
    sl = normalize_mask(q, k, t, total, total)
    n = total // c
    area, klo, khi, pieces = _chunk_tables(sl, n, c)
    units = find_units(sl, _Costs(area, klo, khi, c, LAW), n)
    lo = np.minimum(klo, np.arange(n) * c)
    hi = np.maximum(khi, (np.arange(n) + 1) * c)
    return ChunkTables(area, lo, hi, units, c, cp, LAW, 8), pieces, area, sl


def _kernel_times(owner: np.ndarray, tables: ChunkTables, pieces, area) -> tuple[float, float]:
    """(max fwd + max bwd, its ratio to mean fwd + mean bwd) by the law's exact per-rank times."""
    means: list[float] = []
    _, metric, _ = _exact_price(
        owner, pieces, area, tables.tokens_per_chunk, tables.cp, LAW, None, None, means
    )
    return metric, metric / means[0]


@pytest.mark.parametrize("cp", [4, 8, 16])
def test_polish_keeps_counts_and_lowers_the_slowest_ranks(cp: int) -> None:
    # ranks take equal contiguous runs of a causal pack (the ranks holding long documents' tails are slow);
    # the polish swaps blocks of equal chunk counts until the smoothed slowest ranks stop falling
    tables, pieces, area, _ = _tables(4096 * cp, cp, seed=cp)
    n = area.size
    owner = np.repeat(np.arange(cp), n // cp)
    before = _kernel_times(owner, tables, pieces, area)
    fixed = polish(owner, tables)
    after = _kernel_times(fixed, tables, pieces, area)
    assert np.array_equal(np.bincount(fixed, minlength=cp), np.bincount(owner, minlength=cp))
    assert np.array_equal(owner, np.repeat(np.arange(cp), n // cp))  # the input is left alone
    assert after[0] < before[0] * 0.97 and after[1] < before[1]
    assert np.array_equal(polish(owner, tables), fixed)  # deterministic: every rank polishes alike


def test_the_smoothed_objective_never_rises() -> None:
    # one swap at a time (steps=1, then 2, ...): each swap lowers log-sum-exp(fwd) + log-sum-exp(bwd), the
    # keys of each rank counted here token by token
    cp = 8
    tables, _, area, _ = _tables(2048 * cp, cp, seed=3)
    rng = np.random.default_rng(0)
    owner = rng.permutation(np.repeat(np.arange(cp), area.size // cp))

    def objective(o: np.ndarray, tau: float | None = None) -> tuple[float, float]:
        own = np.bincount(o, minlength=cp) * tables.tokens_per_chunk
        rank_area = np.bincount(o, weights=area, minlength=cp)
        keys = np.zeros(cp)
        for r in range(cp):
            idx = np.flatnonzero(o == r)
            cover = np.zeros(area.size * tables.tokens_per_chunk + 1, dtype=bool)
            for i in idx:
                cover[tables.lo[i] : tables.hi[i]] = True
            keys[r] = cover.sum()
        f, b = LAW.fwd_ms(rank_area, keys, own), LAW.bwd_ms(rank_area, keys, own)
        tau = _TAU * float(f.mean() + b.mean()) if tau is None else tau
        return _lse(f, tau) + _lse(b, tau), tau

    first, tau0 = objective(owner)
    last = first
    for steps in range(1, 6):
        got, _ = objective(polish(owner, tables, steps=steps), tau0)  # at the input's temperature
        assert got < last
        last = got
    assert last < first


def test_polish_leaves_two_ranks_alone() -> None:
    tables, _, area, _ = _tables(4096 * 2, 2, seed=1)
    owner = np.repeat(np.arange(2), area.size // 2)
    assert np.array_equal(polish(owner, tables), owner)


@pytest.mark.parametrize(("cp", "limit"), [(8, 1.05), (16, 1.05)])
def test_the_placement_balances_a_seeded_pack_with_the_polish(cp: int, limit: float) -> None:
    # the placement's pick is polished: the ranks' predicted kernel times within `limit` of their mean,
    # where the fills and the local repair alone leave more (the polish's share of the work is visible)
    import magi_solver.documents as docs

    total = 8192 * cp
    _, _, _, sl = _tables(total, cp, seed=11)
    law = law_for_mask(sl, total)
    plan = documents_plans(sl, total, cp, law)[0]
    polished = price_plan(plan, sl, law).time_imbalance
    real = docs._POLISH
    try:
        docs._POLISH = False
        bare = price_plan(documents_plans(sl, total, cp, law)[0], sl, law).time_imbalance
    finally:
        docs._POLISH = real
    assert polished <= limit
    assert polished <= bare + 1e-9


def test_variants_share_their_set_up_and_match_single_runs() -> None:
    # the placement polishes one pick several ways (links priced or not, runs per unit) from one set-up
    from magi_solver.documents_polish import polish_variants

    cp = 8
    tables, _, area, _ = _tables(4096 * cp, cp, seed=5)
    owner = np.repeat(np.arange(cp), area.size // cp)
    variants = [(0.0, 3), (2.0, 3), (0.0, 2)]
    together = polish_variants(owner, tables, variants)
    for (links, runs), got in zip(variants, together, strict=True):
        assert np.array_equal(got, polish(owner, tables, links=links, runs=runs))
    assert not np.array_equal(together[0], owner)
