"""The capacity bound of `magi_solver.bounds`: no placement with equal tokens per rank beats it by the law."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from magi_solver.bounds import efficiency_bound
from magi_solver.kernel_law import get_kernel_law
from magi_solver.mask import normalize_mask, region_of


def _dense(slices: list, total: int) -> np.ndarray:
    q = np.arange(total)[:, None]
    k = np.arange(total)[None, :]
    out = np.zeros((total, total), dtype=bool)
    for s in slices:
        qs, qe, ks, ke, lo, hi = region_of(*s)
        out |= (q >= qs) & (q < qe) & (k >= ks) & (k < ke) & (k - q >= lo) & (k - q <= hi)
    return out


def _slowest(dense: np.ndarray, owner: np.ndarray, cp: int, law) -> tuple[float, float]:
    """The law's slowest forward and backward rank of a token -> rank assignment, priced from the dense
    mask: area, own tokens plus the keys its rows read elsewhere, rows."""
    fwd, bwd = [], []
    for r in range(cp):
        mine = owner == r
        area = int(dense[mine].sum())
        needed = dense[mine].any(axis=0)
        keys = int(mine.sum() + (needed & ~mine).sum())
        fwd.append(float(law.fwd_ms(area, keys, int(mine.sum()))))
        bwd.append(float(law.bwd_ms(area, keys, int(mine.sum()))))
    return max(fwd), max(bwd)


def _random_mask(rng: np.random.Generator, total: int) -> list:
    """Packed documents of random lengths and types (BI_CAUSAL bands too), some left out."""
    cuts = sorted({0, total, *rng.integers(1, total, size=int(rng.integers(1, 6))).tolist()})
    q, k, t = [], [], []
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        if i and rng.random() < 0.25:  # tokens no row attends from (a rank of them alone costs nothing)
            continue
        kind = ["full", "causal", "inv_causal", "bi_causal"][int(rng.integers(0, 4))]
        q.append([a, b])
        k.append([a, b])
        t.append(kind)
    return normalize_mask(q, k, t, total, total)


@pytest.mark.parametrize("seed", range(12))
def test_no_placement_beats_the_capacity_bound(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cp = int(rng.integers(2, 6))
    total = cp * 4 * int(rng.integers(10, 30))
    slices = _random_mask(rng, total)
    law = get_kernel_law("h200", "cudnn")
    b = efficiency_bound(slices, total, cp, law)
    dense = _dense(slices, total)
    assert int(dense.sum()) > 0
    share = total // cp
    layouts = [np.repeat(np.arange(cp), share)]  # contiguous
    for chunk in (1, 4, share):  # random chunk assignments, equal counts
        for _ in range(40):
            ranks = rng.permutation(np.repeat(np.arange(cp), share // chunk))
            owner = np.repeat(ranks, chunk)
            layouts.append(
                np.concatenate([owner, np.full(total - owner.size, cp - 1)]) if owner.size < total else owner
            )
    for owner in layouts:
        if np.bincount(owner, minlength=cp).max() != share:
            continue
        f, bw = _slowest(dense, owner, cp, law)
        assert b.whole_fwd_ms / (cp * f) <= b.fwd_capacity + 1e-9
        assert b.whole_bwd_ms / (cp * bw) <= b.bwd_capacity + 1e-9


def test_the_capacity_bound_sees_a_unit_too_costly_for_its_length() -> None:
    # one causal document of half the tokens holds 3/4 of the area: balance spreads its late rows over more
    # ranks than its length needs, and each reads its earlier keys; the fewest-cuts estimate misses that
    law = get_kernel_law("h200", "cudnn")
    total, cp = 65536, 8
    lengths = [total // 2] + [1024] * 32
    cu = np.cumsum([0, *lengths]).tolist()
    ranges = [[a, b] for a, b in itertools.pairwise(cu)]
    docs = normalize_mask(ranges, ranges, "causal", total, total)
    b = efficiency_bound(docs, total, cp, law)
    assert b.bwd_capacity < b.bwd - 0.01
    assert 0 < b.fwd_capacity <= 1 and 0 < b.bwd_capacity <= 1


def test_the_capacity_bound_of_a_full_mask_is_the_estimate() -> None:
    # a full mask: every rank holds rows of the one unit and reads all its keys, as the estimate assumes
    law = get_kernel_law("h200", "cudnn")
    total, cp = 16384, 4
    full = normalize_mask([[0, total]], [[0, total]], "full", total, total)
    b = efficiency_bound(full, total, cp, law)
    assert b.bwd_capacity == pytest.approx(b.bwd, rel=1e-6)
    assert b.fwd_capacity == pytest.approx(b.fwd, rel=1e-6)
