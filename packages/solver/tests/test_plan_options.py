"""`plan_attention` is the one door to the planner: the deprecated `plan_dist_attn` (keywords, padded
geometry) and `plan_with_options` (positional chunk size) warn and give its plans; `PlanOptions` is checked
once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import (
    DispatchAlg,
    KVLayout,
    OverlapCostModel,
    OverlapMode,
    PlanOptions,
    get_profile,
    plan_attention,
    plan_dist_attn,
    plan_with_options,
)
from magi_solver.testing import random_mask

GEOMS = [(2, 4, 2), (3, 4, 2), (4, 4, 1), (3, 5, 4), (4, 8, 2)]  # (cp, chunk, per rank)
DEPRECATED = (
    r"`magi_solver\.{}` is deprecated and will be removed in 0\.2\.0: use `magi_solver\.plan_attention`"
)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from(GEOMS),
    st.sampled_from([0, 1, 2, None]),
    st.sampled_from([DispatchAlg.MIN_HEAP, DispatchAlg.SEQUENTIAL, DispatchAlg.AFFINITY]),
    st.booleans(),
)
def test_plan_dist_attn_warns_and_plans_alike(
    seed: int, geom: tuple[int, int, int], degree: int | None, alg: DispatchAlg, uneven: bool
) -> None:
    cp, chunk, per = geom
    n = cp * chunk * per - (chunk // 2 if uneven else 0)
    q, k, t = random_mask(np.random.default_rng(seed), n)
    kwargs = dict(
        overlap_degree=degree,
        min_chunk_size=3,
        max_num_chunks=4,
        dynamic_max_degree=3,
        comm_cost_factor=0.5,
        uneven_shard=uneven,
    )
    with pytest.warns(DeprecationWarning, match=DEPRECATED.format("plan_dist_attn")) as caught:
        by_keywords = plan_dist_attn(q, k, t, n, cp, chunk, dispatch_alg=str(alg), **kwargs)
    assert caught[0].filename == __file__  # the warning points at the caller
    options = PlanOptions(dispatch_alg=alg, overlap_mode=OverlapMode.STATIC, **kwargs)
    as_tuples = tuple(map(tuple, q)), tuple(map(tuple, k)), tuple(t)  # the runtime key's form
    assert plan_attention(*as_tuples, n, cp, chunk_size=chunk, options=options) == by_keywords


@pytest.mark.parametrize("seed", range(4))
def test_cross_attention_plans_alike_with_a_dispatch_and_a_cost_model(seed: int) -> None:
    cp, chunk, n, nk = 3, 4, 48, 36
    rng = np.random.default_rng(seed)
    q, _, t = random_mask(rng, n)
    _, k, _ = random_mask(rng, nk)
    m = min(len(q), len(k))
    q, k, t = q[:m], k[:m], t[:m]
    layout = KVLayout(nk, cp, 3)
    dispatch = plan_attention(
        q, k, t, n, cp, chunk_size=chunk, kv_layout=layout
    ).dispatch  # as after dispatch
    model = OverlapCostModel(
        profile=get_profile("h100", "triton"), num_heads_q=4, num_heads_kv=4, head_dim=64
    )
    options = PlanOptions(overlap_degree=None, overlap_mode=OverlapMode.DYNAMIC, cost_model=model)
    plan = plan_attention(
        q, k, t, n, cp, chunk_size=chunk, options=options, kv_layout=layout, dispatch=dispatch
    )
    with pytest.warns(DeprecationWarning, match=DEPRECATED.format("plan_dist_attn")):
        by_keywords = plan_dist_attn(q, k, t, n, cp, chunk, overlap_degree=None, overlap_mode="dynamic",
                                     cost_model=model, total_seqlen_k=nk, kv_chunk_size=3, dispatch=dispatch)  # fmt: skip
    assert by_keywords == plan and by_keywords.choice == plan.choice
    with pytest.warns(DeprecationWarning, match=DEPRECATED.format("plan_with_options")) as caught:
        typed = plan_with_options(q, k, t, n, cp, chunk, options, kv_layout=layout, dispatch=dispatch)
    assert caught[0].filename == __file__
    assert typed == plan and typed.choice == plan.choice


def test_plan_dist_attn_keeps_its_own_checks() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="kv_chunk_size"):
        plan_dist_attn([[0, 8]], [[0, 8]], [0], 8, 2, 2, kv_chunk_size=2)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="total_seqlen"):
        plan_dist_attn([[0, 9]], [[0, 9]], [0], 9, 2, 2)  # not padded: plan_attention would pad it


def test_options_are_checked_and_normalised_once() -> None:
    options = PlanOptions(overlap_degree=None, min_chunk_size=np.int64(4), comm_cost_factor=2)
    assert options.overlap_mode is OverlapMode.DYNAMIC and type(options.min_chunk_size) is int
    assert type(options.comm_cost_factor) is float
    with pytest.raises(ValueError, match="overlap_degree"):
        PlanOptions(overlap_degree=-1)
    with pytest.raises(TypeError, match="cost_model"):
        PlanOptions(cost_model="h100")
    with pytest.raises(TypeError, match="options"):
        plan_attention([[0, 8]], [[0, 8]], [0], 8, 2, chunk_size=4, options={"overlap_degree": 1})
    with pytest.raises(ValueError, match="kv_layout"):
        plan_attention([[0, 8]], [[0, 8]], [0], 8, 2, chunk_size=4, kv_layout=KVLayout(12, 3, 4))
