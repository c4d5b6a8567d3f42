"""Cross-attention plans: queries dispatched by area, keys and values in contiguous shards; every (q, k) pair
exactly once, no key fetched twice or fetched when held, GroupCast routing that delivers the keys asked for."""

from __future__ import annotations

import random

import numpy as np
import pytest

from magi_solver import KVLayout, PlanOptions, plan_attention
from magi_solver.testing import dense_mask, plan_coverage, simulate_group_cast


def _random_cross_mask(rng: random.Random, tq: int, tk: int, n: int):
    qr, kr, tm = [], [], []
    for _ in range(n):
        a, b = sorted(rng.randrange(tq + 1) for _ in range(2))
        c, d = sorted(rng.randrange(tk + 1) for _ in range(2))
        if a < b and c < d:
            qr.append([a, b])
            kr.append([c, d])
            tm.append(rng.randrange(4))
    return qr, kr, tm


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("degree", [0, 1, 2, None])
@pytest.mark.parametrize("seed", range(4))
def test_cross_plan_covers_the_mask_once(cp: int, degree, seed: int) -> None:
    rng = random.Random(seed * 10 + cp)
    cq, ck = rng.choice([2, 3, 4]), rng.choice([2, 3, 5])
    tq, tk = cq * cp * rng.randint(2, 5), ck * cp * rng.randint(1, 6)
    qr, kr, tm = _random_cross_mask(rng, tq, tk, rng.randint(1, 7))
    plan = plan_attention(
        qr,
        kr,
        tm,
        tq,
        cp,
        chunk_size=cq,
        options=PlanOptions(overlap_degree=degree, min_chunk_size=2),
        kv_layout=KVLayout(tk, cp, ck),
    )
    dense = (dense_mask(qr, kr, tm, tq, tk) > 0).astype(np.int64)  # the union of the slices
    assert (plan_coverage(plan) == dense).all()
    assert (plan_coverage(plan, merged=True) == dense).all()
    kv = plan.kv_layout
    assert isinstance(kv, KVLayout) and kv.shard_seqlen * cp == tk
    # each rank fetches exactly the keys its rows need that it does not hold, once
    for rp in plan.ranks:
        rows = np.asarray(rp.host_token_ranges.token_ids())
        own = set(kv.host_token_ranges(rp.rank).token_ids())
        need = set(np.flatnonzero(dense[rows].any(axis=0)).tolist()) - own
        fetched = [t for st in rp.stages for t in st.remote_k_ranges.token_ids()]
        assert sorted(fetched) == sorted(need)
    # GroupCast delivers, into every stage buffer, the global key ids the plan says it holds
    for si in range(plan.num_stages):
        inputs = [np.asarray(kv.host_token_ranges(r).token_ids(), dtype=np.int64) for r in range(cp)]
        got = simulate_group_cast([rp.stages[si].cast for rp in plan.ranks], inputs)
        for rp, buf in zip(plan.ranks, got):
            assert buf.tolist() == rp.stages[si].remote_k_ranges.token_ids()


def test_cross_plan_rejects_bad_geometry() -> None:
    with pytest.raises(ValueError):
        plan_attention([[0, 8]], [[0, 10]], [0], 8, 2, chunk_size=2, kv_layout=KVLayout(10, 2, 3))  # 10 % 6
    with pytest.raises(ValueError, match="affinity"):
        plan_attention(
            [[0, 8]],
            [[0, 12]],
            [0],
            8,
            2,
            chunk_size=2,
            options=PlanOptions(dispatch_alg="affinity"),
            kv_layout=KVLayout(12, 2, 2),
        )
    with pytest.raises(ValueError):
        plan_attention(
            [[0, 8]], [[0, 13]], [0], 8, 2, chunk_size=2, kv_layout=KVLayout(12, 2, 2)
        )  # key range past total_k
