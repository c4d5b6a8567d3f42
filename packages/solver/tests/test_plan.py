"""The full plan: exact coverage (dense), zero redundancy, mutually consistent GroupCast args and their
exact transpose, overlap stages."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import DistAttnPlan, PlanOptions, estimate_cost_factors, plan_attention
from magi_solver.overlap import group_chunks, overlap_chunk_bounds, predicted_time
from magi_solver.testing import check_plan, dense_mask, random_mask

GEOMS = [
    (1, 8, 2),
    (2, 4, 2),
    (3, 4, 2),
    (5, 2, 2),
    (4, 4, 1),
    (6, 2, 2),
    (7, 4, 1),
    (3, 5, 4),
    (5, 3, 4),
    (4, 8, 2),
]  # (cp, chunk, per rank)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from(GEOMS),
    st.sampled_from([0, 1, 2, 3, None]),
    st.sampled_from(["min_heap", "sequential", "affinity"]),
    st.sampled_from([1, 3, 8]),
)
def test_plan_exact_on_random_masks(
    seed: int, geom: tuple[int, int, int], degree: int | None, alg: str, min_chunk: int
) -> None:
    cp, chunk, per = geom
    n = cp * chunk * per
    q, k, t = random_mask(np.random.default_rng(seed), n)
    plan = plan_attention(
        q,
        k,
        t,
        n,
        cp,
        chunk_size=chunk,
        options=PlanOptions(
            dispatch_alg=alg,
            overlap_degree=degree,
            min_chunk_size=min_chunk,
            max_num_chunks=4,
            dynamic_max_degree=3,
            comm_cost_factor=0.5,
        ),
    )
    assert plan.num_stages == (max(plan.overlap_degree, 1))
    if degree is not None:
        assert plan.overlap_degree == degree
    # the cost model's prediction must match the stages actually built
    if plan.overlap_degree > 0:
        assert list(plan.predicted_times) == pytest.approx(_times(plan, 0.5))
    else:
        assert list(plan.predicted_times) == pytest.approx(
            [0.5 * rp.num_remote_tokens + rp.area for rp in plan.ranks]
        )
    check_plan(plan, dense_mask(q, k, t, n, n))


@pytest.mark.parametrize("mask_type", [0, 1, 2, 3])
@pytest.mark.parametrize("cp", [3, 5])
def test_plan_single_type_documents(mask_type: int, cp: int) -> None:
    n = cp * 4 * 6
    cu = [0, 7, 30, 31, 55, n]
    q = [[a, b] for a, b in itertools.pairwise(cu)]
    k = [[max(0, a - 3), b] for a, b in q]  # k ranges reach 3 keys into the previous document: they overlap
    plan = plan_attention(
        q, k, mask_type, n, cp, chunk_size=6, options=PlanOptions(overlap_degree=2, min_chunk_size=4)
    )
    check_plan(plan, dense_mask(q, k, mask_type, n, n))


def test_plan_slices_are_few_for_varlen_causal() -> None:
    cu = [0, 3000, 3100, 9000, 16384]
    q = [[a, b] for a, b in itertools.pairwise(cu)]
    plan = plan_attention(q, q, "causal", 16384, 4, chunk_size=256, options=PlanOptions(overlap_degree=2))
    for rp in plan.ranks:
        # each rank has 16 chunks; a clipped causal document piece needs at most a few slices
        assert len(rp.host_slices) <= 3 * 16
        assert len(rp.merged_slices) <= len(rp.host_slices) + sum(len(s.remote_slices) for s in rp.stages)


def test_full_mask_merges_into_one_host_slice() -> None:
    plan = plan_attention(
        [[0, 64]], [[0, 64]], "full", 64, 2, chunk_size=8, options=PlanOptions(overlap_degree=0)
    )
    for rp in plan.ranks:
        assert len(rp.host_slices) == 1 and rp.host_slices.q_ranges[0] == (0, 32)
        assert len(rp.merged_slices) == 1 and rp.merged_slices.k_ranges[0] == (0, 64)
        assert rp.num_remote_tokens == 32


def test_estimate_cost_factors() -> None:
    calc, comm = estimate_cost_factors(64, 8, 128, tflops=400.0, comm_gbps=200.0)
    assert calc == pytest.approx(4 * 64 * 128 / 400e12)
    assert comm == pytest.approx(2 * 8 * 128 * 2 / 200e9)
    calc_b, comm_b = estimate_cost_factors(64, 8, 128, backward=True)
    assert calc_b == pytest.approx(2.5 * calc) and comm_b == pytest.approx(2 * comm)


def test_overlap_helpers() -> None:
    assert overlap_chunk_bounds(0, 4, 2) == [0]
    assert overlap_chunk_bounds(10, 4, 8) == [0, 4, 8, 10]
    assert overlap_chunk_bounds(10, 2, 3) == [0, 4, 8, 10]  # would be 5 chunks > 3: chunks of ceil(10/3)
    assert group_chunks(5, 2) == [0, 3, 5] and group_chunks(1, 3) == [0, 1, 1, 1]
    assert predicted_time(4.0, [3.0, 5.0], [2.0, 1.0]) == 4.0 + 5.0 + 1.0


def test_dynamic_degree_minimises_the_slowest_rank() -> None:
    n = 4096
    q = [[0, n]]
    # degree 0 (one merged stage) is a dynamic candidate too, so it is part of the minimum
    plans = {
        d: plan_attention(
            q,
            q,
            "causal",
            n,
            4,
            chunk_size=128,
            options=PlanOptions(overlap_degree=d, min_chunk_size=128, comm_cost_factor=1000.0),
        )
        for d in range(0, 5)
    }
    dyn = plan_attention(
        q,
        q,
        "causal",
        n,
        4,
        chunk_size=128,
        options=PlanOptions(
            overlap_mode="dynamic", min_chunk_size=128, dynamic_max_degree=4, comm_cost_factor=1000.0
        ),
    )
    best = min(max(plans[d].predicted_times) for d in plans)
    assert max(dyn.predicted_times) == pytest.approx(best)
    assert dyn.degree_costs == pytest.approx({d: max(p.predicted_times) for d, p in plans.items()})
    for d in range(1, 5):  # the factor estimate of a pipelined plan, recomputed from its stages
        assert list(plans[d].predicted_times) == pytest.approx(_times(plans[d], 1000.0))
    assert dyn.overlap_degree > 1  # comm is expensive here: overlapping must pay
    assert all(len(rp.stages) == dyn.num_stages for rp in dyn.ranks)


def test_dynamic_degree_is_zero_when_no_rank_needs_remote_keys() -> None:
    # Every document sits inside one rank's shard: no remote K/V, so every degree costs the same under the
    # factor estimate and the tie goes to degree 0 (before degree 0 was a candidate this picked 1).
    cu = [0, 16, 32, 48, 64]
    q = [[a, b] for a, b in itertools.pairwise(cu)]
    plan = plan_attention(
        q,
        q,
        "causal",
        64,
        4,
        chunk_size=8,
        options=PlanOptions(dispatch_alg="sequential", overlap_degree=None, dynamic_max_degree=3),
    )
    assert plan.remote_tokens_per_rank == (0, 0, 0, 0)
    assert plan.overlap_degree == 0 and plan.num_stages == 1
    assert plan.degree_costs == {0: 136.0, 1: 136.0, 2: 136.0, 3: 136.0}  # one 16-token causal document


def _times(plan: DistAttnPlan, comm_f: float) -> list[float]:
    return [
        predicted_time(
            rp.host_area, [comm_f * s.num_remote_tokens for s in rp.stages], [s.area for s in rp.stages]
        )
        for rp in plan.ranks
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"overlap_degree": -1}, "overlap_degree", id="negative-degree"),
        pytest.param({"overlap_mode": "greedy"}, "overlap_mode", id="bad-mode"),
        pytest.param({"min_chunk_size": 0}, "min_chunk_size", id="min-chunk"),
        pytest.param({"max_num_chunks": 0}, "max_num_chunks", id="max-chunks"),
        pytest.param({"dynamic_max_degree": 0}, "dynamic_max_degree", id="max-degree"),
        pytest.param({"comm_cost_factor": float("nan")}, "comm_cost_factor", id="nan-cost"),
        pytest.param({"calc_cost_factor": -1.0}, "calc_cost_factor", id="negative-cost"),
        pytest.param({"dispatch_alg": "best"}, "alg", id="bad-alg"),
        pytest.param({"chunk_size": 0}, "chunk_size", id="chunk"),
    ],
)
def test_plan_rejects(kwargs: dict, match: str) -> None:
    args = {"chunk_size": 8} | kwargs
    chunk = args.pop("chunk_size")
    with pytest.raises(ValueError, match=match):
        plan_attention([[0, 64]], [[0, 64]], "causal", 64, 2, chunk_size=chunk, options=PlanOptions(**args))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("cp", "chunk"), [(3, 8), (4, 6), (6, 4)])
def test_plan_exact_on_larger_random_masks(seed: int, cp: int, chunk: int) -> None:
    n = 192
    q, k, t = random_mask(np.random.default_rng(1000 + seed), n, max_cells=14, raw_slices=10)
    for degree in (0, 2, None):
        plan = plan_attention(
            q,
            k,
            t,
            n,
            cp,
            chunk_size=chunk,
            options=PlanOptions(
                overlap_degree=degree,
                min_chunk_size=5,
                max_num_chunks=6,
                dynamic_max_degree=4,
                comm_cost_factor=3.0,
            ),
        )
        check_plan(plan, dense_mask(q, k, t, n, n))
