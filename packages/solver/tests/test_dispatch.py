"""Dispatch solver: permutations with equal counts, exact chunk areas, algorithms, lower bound, bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import DispatchAlg, dispatch_lower_bound, solve_dispatch
from magi_solver.chunk_assignment import _comm_swaps, _estimated_comm, _min_heap
from magi_solver.chunk_geometry import _key_need_matrix, chunk_areas
from magi_solver.mask import normalize_mask
from magi_solver.testing import dense_mask, random_mask

ALGS = [a.value for a in DispatchAlg]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([(1, 4), (2, 4), (3, 4), (5, 2), (4, 6), (2, 8)]),
    st.sampled_from(ALGS),
)
def test_dispatch_is_equal_count_permutation_with_exact_areas(
    seed: int, geom: tuple[int, int], alg: str
) -> None:
    cp, chunk = geom
    per = 2 * int(np.random.default_rng(seed).integers(1, 3))  # even: zigzag needs it
    n = cp * per * chunk
    q, k, t = random_mask(np.random.default_rng(seed), n)
    plan = solve_dispatch(q, k, t, n, cp, chunk, alg=alg)
    assert plan.num_chunks == n // chunk and len(plan.partitions) == cp
    assert all(len(p) == per and list(p) == sorted(p) for p in plan.partitions)
    assert sorted(c for p in plan.partitions for c in p) == list(range(plan.num_chunks))
    dense = dense_mask(q, k, t, n, n)
    rows = dense.sum(axis=1)
    assert list(plan.chunk_areas) == [
        int(rows[c * chunk : (c + 1) * chunk].sum()) for c in range(plan.num_chunks)
    ]
    assert sum(plan.chunk_areas) == dense.sum()
    assert plan.rank_areas == tuple(sum(plan.chunk_areas[c] for c in p) for p in plan.partitions)
    assert max(plan.rank_areas) >= plan.lower_bound
    perm = plan.permutation
    assert sorted(perm.tolist()) == list(range(n))
    assert (perm[plan.unpermutation] == np.arange(n)).all()
    for r in range(cp):
        assert (
            plan.position_ids(r).tolist()
            == perm[r * plan.shard_seqlen : (r + 1) * plan.shard_seqlen].tolist()
        )
        assert plan.host_token_ranges(r).token_ids() == plan.position_ids(r).tolist()


def test_min_heap_docstring_counter_example_and_lower_bound() -> None:
    areas = [8, 7, 6, 5, 4, 2, 2, 2]
    parts = _min_heap(areas, 2, refine=False)
    loads = sorted(sum(areas[c] for c in p) for p in parts)
    assert loads == [17, 19]  # greedy alone; the optimum is 18/18
    assert dispatch_lower_bound(areas, 2) == 18
    refined = _min_heap(areas, 2)
    assert sorted(sum(areas[c] for c in p) for p in refined) == [18, 18]  # the swap pass finds it
    assert sorted(c for p in refined for c in p) == list(range(8)) and all(len(p) == 4 for p in refined)


@pytest.mark.parametrize("seed", range(6))
def test_lower_bound_below_brute_force_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    areas = rng.integers(0, 50, size=6).tolist()
    best = min(
        max(sum(areas[c] for c in g), sum(areas[c] for c in range(6) if c not in g))
        for g in itertools.combinations(range(6), 3)
    )
    assert (
        dispatch_lower_bound(areas, 2) <= best <= max(sum(areas[c] for c in p) for p in _min_heap(areas, 2))
    )


def test_zigzag_is_head_tail() -> None:
    plan = solve_dispatch([[0, 64]], [[0, 64]], "causal", 64, 4, 4, alg="zigzag")
    assert plan.partitions == ((0, 1, 14, 15), (2, 3, 12, 13), (4, 5, 10, 11), (6, 7, 8, 9))
    assert plan.imbalance == pytest.approx(1.0)
    seq = solve_dispatch([[0, 64]], [[0, 64]], "causal", 64, 4, 4, alg="sequential")
    assert seq.partitions[0] == (0, 1, 2, 3) and seq.imbalance > 1.5


def test_min_heap_balances_varlen_causal_better_than_sequential() -> None:
    cu = [0, 1000, 1100, 3000, 3100, 4096]
    q = [[a, b] for a, b in itertools.pairwise(cu)]
    heap = solve_dispatch(q, q, "causal", 4096, 8, 64)
    seq = solve_dispatch(q, q, "causal", 4096, 8, 64, alg="sequential")
    assert heap.imbalance < 1.02 < seq.imbalance
    assert heap.imbalance >= heap.lower_bound_imbalance


def test_affinity_keeps_documents_together_more_than_min_heap() -> None:
    # many short full-attention documents: affinity should put a document's chunks on fewer ranks
    cu = list(range(0, 8192 + 1, 512))
    q = [[a, b] for a, b in itertools.pairwise(cu)]
    aff = solve_dispatch(q, q, "full", 8192, 4, 128, alg="affinity")
    heap = solve_dispatch(q, q, "full", 8192, 4, 128)

    def spread(plan):  # number of (document, rank) pairs
        owner = plan.chunk_owner
        return sum(len({owner[c] for c in range(a // 128, b // 128)}) for a, b in q)

    assert spread(aff) < spread(heap)
    assert aff.imbalance == pytest.approx(1.0)


def test_comm_swaps_lower_the_busiest_fetch_and_keep_the_balance() -> None:
    # heavy-tailed causal documents: min-heap's balanced assignment scatters the long ones; the swaps bring
    # their chunks back to the rank fetching the most, with the counts kept and no load above the cap
    rng = np.random.default_rng(0)
    lens = np.maximum(16, (rng.lognormal(0.0, 1.2, 60) * 300).astype(int))
    cu = [0, *np.cumsum(lens).tolist()]
    total = -(-cu[-1] // (8 * 64)) * 8 * 64
    q = [[a, b] for a, b in itertools.pairwise(cu)]
    sl = normalize_mask(q, q, "causal", total, total)
    areas = chunk_areas(sl, total, 64).tolist()
    parts = _min_heap(areas, 8)
    need = _key_need_matrix(sl, len(areas), 64)
    cap = max(sum(areas[c] for c in p) for p in parts)
    before, counts = _estimated_comm(need, parts), [len(p) for p in parts]
    _comm_swaps(need, areas, parts, cap)
    assert sorted(c for p in parts for c in p) == list(range(len(areas)))
    assert [len(p) for p in parts] == counts
    assert max(sum(areas[c] for c in p) for p in parts) <= cap
    assert _estimated_comm(need, parts) < 0.9 * before  # 20040 -> 16185 keys


def test_chunk_areas_vectorised_matches_dense_with_many_slices() -> None:
    rng = np.random.default_rng(7)
    q, k, t = random_mask(rng, 96, max_cells=12)
    sl = normalize_mask(q, k, t, 96, 96)
    rows = dense_mask(q, k, t, 96, 96).sum(axis=1)
    assert chunk_areas(sl, 96, 8).tolist() == rows.reshape(12, 8).sum(axis=1).tolist()


def test_cp1_and_empty_rows() -> None:
    plan = solve_dispatch([[0, 4]], [[0, 4]], 0, 32, 1, 8)
    assert plan.partitions == ((0, 1, 2, 3),) and plan.rank_areas == (16,) and plan.imbalance == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"chunk_size": 5}, "chunk_size", id="chunk-not-dividing"),
        pytest.param({"cp_size": 3}, "cp_size", id="cp-not-dividing-chunks"),
        pytest.param({"cp_size": 32}, "larger than the chunk count", id="cp-larger-than-chunks"),
        pytest.param({"cp_size": 0}, "cp_size", id="cp-zero"),
        pytest.param({"chunk_size": -8}, "chunk_size", id="chunk-negative"),
        pytest.param({"total_seqlen": 0}, "total_seqlen", id="total-zero"),
        pytest.param({"alg": "random"}, "alg", id="unknown-alg"),
        pytest.param(
            {"alg": "zigzag", "cp_size": 4, "chunk_size": 16}, "even number of chunks", id="zigzag-odd"
        ),
        pytest.param({"q_ranges": [[0, 80]]}, r"q_ranges\[0\].*outside", id="range-outside"),
        pytest.param({"attn_mask_type": 7}, "attn_mask_type", id="bad-type"),
    ],
)
def test_solve_dispatch_rejects(kwargs: dict, match: str) -> None:
    args = {
        "q_ranges": [[0, 64]],
        "k_ranges": [[0, 64]],
        "attn_mask_type": "causal",
        "total_seqlen": 64,
        "cp_size": 2,
        "chunk_size": 8,
    } | kwargs
    with pytest.raises(ValueError, match=match):
        solve_dispatch(**args)


def test_solve_dispatch_type_errors() -> None:
    with pytest.raises(TypeError, match="chunk_size"):
        solve_dispatch([[0, 8]], [[0, 8]], 0, 8, 1, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="q_ranges"):
        solve_dispatch("0,8", [[0, 8]], 0, 8, 1, 2)


def test_affinity_refuses_huge_chunk_counts() -> None:
    with pytest.raises(ValueError, match="affinity"):
        solve_dispatch([[0, 8192]], [[0, 8192]], "causal", 8192, 2, 1, alg="affinity")
