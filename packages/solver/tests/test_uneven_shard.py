"""Uneven shards: no padding, a short last chunk, chunk counts within one; the plan's invariants (exact
coverage, zero redundancy, GroupCast / GroupReduce routing) hold with per-rank local lengths."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import DispatchAlg, KVLayout, PlanOptions, plan_attention, solve_dispatch
from magi_solver.chunk_assignment import _refine_swaps
from magi_solver.testing import check_plan, dense_mask, plan_coverage, random_mask, simulate_group_cast

ALGS = [a.value for a in DispatchAlg]


def _check_uneven_dispatch(plan, total: int, cp: int, chunk: int, dense: np.ndarray) -> None:
    n = -(-total // chunk)
    assert plan.uneven_shard and plan.num_chunks == n and plan.total_seqlen == total
    counts = [len(p) for p in plan.partitions]
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1, counts
    assert sorted(c for p in plan.partitions for c in p) == list(range(n))
    # exact areas per chunk, the last one short
    rows = dense.sum(axis=1)
    assert [plan.chunk_range(c) for c in range(n)][-1] == ((n - 1) * chunk, total)
    assert list(plan.chunk_areas) == [int(rows[a:b].sum()) for a, b in map(plan.chunk_range, range(n))]
    assert plan.rank_areas == tuple(sum(plan.chunk_areas[c] for c in p) for p in plan.partitions)
    assert max(plan.rank_areas) >= plan.lower_bound
    # local lengths, permutation and position ids agree, and never exceed a padded plan's shard
    lens = plan.shard_seqlens
    assert sum(lens) == total and plan.shard_seqlen == max(lens) <= -(-n // cp) * chunk
    perm = plan.permutation
    assert sorted(perm.tolist()) == list(range(total))
    assert (perm[plan.unpermutation] == np.arange(total)).all()
    offsets = np.cumsum([0, *lens])
    for r in range(cp):
        ids = plan.position_ids(r)
        assert len(ids) == lens[r] and ids.tolist() == perm[offsets[r] : offsets[r + 1]].tolist()
        assert plan.host_token_ranges(r).token_ids() == ids.tolist()


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 5),
    st.integers(1, 7),
    st.sampled_from(ALGS),
)
def test_uneven_dispatch_is_a_permutation_with_exact_areas(seed: int, cp: int, chunk: int, alg: str) -> None:
    rng = np.random.default_rng(seed)
    total = int(rng.integers(cp * chunk - chunk + 1, 4 * cp * chunk + 1))  # often not a multiple of anything
    total = max(total, 2)
    q, k, t = random_mask(rng, total)
    plan = solve_dispatch(q, k, t, total, cp, chunk, alg=alg, uneven_shard=True)
    _check_uneven_dispatch(plan, total, cp, chunk, dense_mask(q, k, t, total, total))


def test_uneven_equals_padded_geometry_when_nothing_is_short() -> None:
    """A length the padded geometry accepts gives the very same plan with uneven_shard."""
    cu = [0, 100, 160, 300, 384]
    q = [[a, b] for a, b in itertools.pairwise(cu)]
    for alg in ALGS:
        even = solve_dispatch(q, q, "causal", 384, 4, 8, alg=alg)
        uneven = solve_dispatch(q, q, "causal", 384, 4, 8, alg=alg, uneven_shard=True)
        assert uneven.partitions == even.partitions and uneven.shard_seqlens == (96,) * 4


def test_uneven_counts_and_the_short_chunk() -> None:
    # 10 chunks (the last of 3 tokens) on 4 ranks: counts 3, 3, 2, 2 in some order
    plan = solve_dispatch([[0, 39]], [[0, 39]], "causal", 39, 4, 4, uneven_shard=True)
    assert sorted(len(p) for p in plan.partitions) == [2, 2, 3, 3]
    assert sum(plan.shard_seqlens) == 39 and plan.chunk_range(9) == (36, 39)
    seq = solve_dispatch([[0, 39]], [[0, 39]], "causal", 39, 4, 4, alg="sequential", uneven_shard=True)
    assert seq.partitions == ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9)) and seq.shard_seqlens == (12, 12, 8, 7)
    zig = solve_dispatch([[0, 39]], [[0, 39]], "causal", 39, 2, 4, alg="zigzag", uneven_shard=True)
    assert zig.partitions == ((0, 1, 2, 8, 9), (3, 4, 5, 6, 7))  # blocks 3,3,2,2: rank 0 = 0 + 3
    # a causal mask stays balanced without padding
    big = solve_dispatch([[0, 1999]], [[0, 1999]], "causal", 1999, 3, 16, uneven_shard=True)
    assert big.imbalance < 1.01


def test_refine_swaps_keeps_counts_within_one() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        cp = int(rng.integers(2, 6))
        n = int(rng.integers(cp, 5 * cp))
        areas = rng.integers(0, 100, size=n).tolist()
        base, extra = divmod(n, cp)
        parts = [list(range(r * base + min(r, extra), (r + 1) * base + min(r + 1, extra))) for r in range(cp)]
        before = max(sum(areas[c] for c in p) for p in parts)
        _refine_swaps(areas, parts)
        counts = [len(p) for p in parts]
        assert sorted(counts) == sorted(base + (r < extra) for r in range(cp))
        assert sorted(c for p in parts for c in p) == list(range(n))
        assert max(sum(areas[c] for c in p) for p in parts) <= before


# (cp, chunk, total)
GEOMS = [(1, 5, 13), (2, 4, 30), (3, 4, 50), (3, 7, 61), (4, 3, 31), (5, 2, 23), (4, 8, 33)]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from(GEOMS),
    st.sampled_from([0, 1, 2, None]),
    st.sampled_from(["min_heap", "sequential", "zigzag", "affinity"]),
)
def test_uneven_plan_is_exact(seed: int, geom: tuple[int, int, int], degree, alg: str) -> None:
    cp, chunk, total = geom
    q, k, t = random_mask(np.random.default_rng(seed), total)
    plan = plan_attention(
        q,
        k,
        t,
        total,
        cp,
        chunk_size=chunk,
        options=PlanOptions(
            dispatch_alg=alg,
            overlap_degree=degree,
            min_chunk_size=3,
            max_num_chunks=4,
            dynamic_max_degree=2,
            uneven_shard=True,
        ),
    )
    check_plan(plan, dense_mask(q, k, t, total, total))
    for rp, n in zip(plan.ranks, plan.dispatch.shard_seqlens):
        assert rp.local_seqlen == n
        for s in rp.stages:
            assert sum(s.cast.input_split_sizes) == n
    # a second mask over the same (uneven) dispatch
    q2, k2, t2 = random_mask(np.random.default_rng(seed + 1), total)
    again = plan_attention(
        q2,
        k2,
        t2,
        total,
        cp,
        chunk_size=chunk,
        options=PlanOptions(uneven_shard=True),
        dispatch=plan.dispatch,
    )
    assert again.dispatch.partitions == plan.dispatch.partitions
    check_plan(again, dense_mask(q2, k2, t2, total, total))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(3))
def test_uneven_cross_plan(cp: int, seed: int) -> None:
    rng = np.random.default_rng(seed * 7 + cp)
    cq, ck = int(rng.integers(2, 5)), int(rng.integers(2, 6))
    tq = int(rng.integers(cq * cp, 4 * cq * cp + 3))
    tk = int(rng.integers(ck * cp, 4 * ck * cp + 3))
    qr, kr, tm = [], [], []
    for _ in range(int(rng.integers(1, 6))):
        a, b = sorted(int(x) for x in rng.integers(0, tq + 1, size=2))
        c, d = sorted(int(x) for x in rng.integers(0, tk + 1, size=2))
        if a < b and c < d:
            qr.append([a, b]), kr.append([c, d]), tm.append(int(rng.integers(4)))
    if not qr:
        qr, kr, tm = [[0, tq]], [[0, tk]], [0]
    plan = plan_attention(
        qr,
        kr,
        tm,
        tq,
        cp,
        chunk_size=cq,
        options=PlanOptions(overlap_degree=1, min_chunk_size=2, uneven_shard=True),
        kv_layout=KVLayout(tk, cp, ck, True),
    )
    dense = (dense_mask(qr, kr, tm, tq, tk) > 0).astype(np.int64)
    assert (plan_coverage(plan) == dense).all() and (plan_coverage(plan, merged=True) == dense).all()
    kv = plan.kv_layout
    assert kv.uneven_shard and kv.total_seqlen == tk and sum(kv.shard_seqlens) == tk
    assert [kv.host_pairs(r)[0] for r in range(cp)] == list(
        itertools.pairwise(np.cumsum([0, *kv.shard_seqlens]).tolist())
    )
    inputs = [np.asarray(kv.host_token_ranges(r).token_ids(), dtype=np.int64) for r in range(cp)]
    for si in range(plan.num_stages):
        casts = [rp.stages[si].cast for rp in plan.ranks]
        assert [sum(c.input_split_sizes) for c in casts] == list(kv.shard_seqlens)
        for rp, buf in zip(plan.ranks, simulate_group_cast(casts, inputs)):
            assert buf.tolist() == rp.stages[si].remote_k_ranges.token_ids()


def test_kv_layout_uneven() -> None:
    kv = KVLayout(23, 3, 4, uneven_shard=True)  # 6 chunks, the last of 3 tokens: 2 per rank
    assert kv.shard_seqlens == (8, 8, 7) and kv.shard_seqlen == 8
    assert kv.chunk_owner == (0, 0, 1, 1, 2, 2) and kv.chunk_local_offsets() == [0, 4, 0, 4, 0, 4]
    kv = KVLayout(21, 4, 4, uneven_shard=True)  # 6 chunks on 4 ranks: 2, 2, 1, 1
    assert kv.shard_seqlens == (8, 8, 4, 1) and kv.chunk_owner == (0, 0, 1, 1, 2, 3)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        pytest.param((10, 4, 4), "larger than the chunk count", id="fewer-chunks-than-ranks"),
        pytest.param((3, 4, 1), "fewer ranks than tokens", id="fewer-tokens-than-ranks"),
    ],
)
def test_uneven_rejects(args: tuple[int, int, int], match: str) -> None:
    total, cp, chunk = args
    with pytest.raises(ValueError, match=match):
        solve_dispatch([[0, total]], [[0, total]], 0, total, cp, chunk, uneven_shard=True)
    with pytest.raises(ValueError, match=match):
        KVLayout(total, cp, chunk, uneven_shard=True)


def test_uneven_flag_must_match_a_given_dispatch() -> None:
    padded = solve_dispatch([[0, 32]], [[0, 32]], 1, 32, 2, 4)
    with pytest.raises(ValueError, match="uneven_shard"):
        plan_attention(
            [[0, 32]],
            [[0, 32]],
            1,
            32,
            2,
            chunk_size=4,
            options=PlanOptions(uneven_shard=True),
            dispatch=padded,
        )
    with pytest.raises(TypeError, match="uneven_shard"):
        solve_dispatch([[0, 32]], [[0, 32]], 1, 32, 2, 4, uneven_shard=1)


def test_dispatch_plan_rejects_counts_that_differ_by_more_than_one() -> None:
    """A hand-built uneven plan must keep to the count rule the runtime's buffers rely on."""
    from magi_solver import DispatchAlg, DispatchPlan

    common = dict(total_seqlen=40, cp_size=2, chunk_size=8, num_chunks=5, chunk_areas=(1,) * 5,
                  alg=DispatchAlg.MIN_HEAP, lower_bound=1, uneven_shard=True)  # fmt: skip
    DispatchPlan(partitions=((0, 1, 2), (3, 4)), rank_areas=(3, 2), **common)
    with pytest.raises(ValueError, match="differ by at most one"):
        DispatchPlan(partitions=((0, 1, 2, 3), (4,)), rank_areas=(4, 1), **common)
