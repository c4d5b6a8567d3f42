"""The plan on the builders' masks (odd world sizes, every overlap degree), purity, and the demo."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import magi_solver
from magi_solver import PlanOptions, plan_attention, solve_dispatch
from magi_solver.builders import (
    make_block_causal_mask,
    make_global_window_mask,
    make_prefix_lm_mask,
    make_shared_question_mask,
    make_sliding_window_mask,
    make_varlen_causal_mask,
)
from magi_solver.demo import main as demo_main
from magi_solver.demo import varlen_doc_lengths
from magi_solver.testing import check_plan, dense_mask

CU = [0, 13, 14, 40, 41, 90, 105]  # 105 = 3 * 5 * 7: cp 3, 5 and 7 with chunk 5, 7 or 3

MASKS = {
    "varlen-causal": make_varlen_causal_mask(CU),
    "swa": make_sliding_window_mask(CU, (6, 0)),
    "swa-bidirectional": make_sliding_window_mask(CU, (4, 3)),
    "global-window": make_global_window_mask(CU, (5, 0), 2),
    "block-causal": make_block_causal_mask(CU, 4),
    "prefix-lm": make_prefix_lm_mask(CU, [3, 0, 10, 1, 20, 15]),
    "shared-question": make_shared_question_mask([10, 7], [[8, 20, 5], [30, 25]]),
}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize(("cp", "chunk"), [(3, 5), (5, 7), (7, 3)])
@pytest.mark.parametrize("degree", [0, 1, 3])
def test_plan_on_builder_masks(name: str, cp: int, chunk: int, degree: int) -> None:
    q, k, t = MASKS[name]
    n = 105
    plan = plan_attention(
        q,
        k,
        t,
        n,
        cp,
        chunk_size=chunk,
        options=PlanOptions(overlap_degree=degree, min_chunk_size=4, max_num_chunks=5),
    )
    check_plan(plan, dense_mask(q, k, t, n, n))


def test_plan_with_zigzag_and_affinity_dispatch() -> None:
    q, k, t = make_sliding_window_mask([0, 13, 40, 90, 120], (6, 0))  # 120 = 3 ranks x 8 chunks x 5
    for alg in ("zigzag", "affinity", "sequential"):
        plan = plan_attention(
            q,
            k,
            t,
            120,
            3,
            chunk_size=5,
            options=PlanOptions(dispatch_alg=alg, overlap_degree=2, min_chunk_size=2),
        )
        assert plan.dispatch.alg == alg
        check_plan(plan, dense_mask(q, k, t, 120, 120))


def test_cp1_plan_has_only_empty_stages() -> None:
    q, k, t = MASKS["prefix-lm"]
    plan = plan_attention(q, k, t, 105, 1, chunk_size=5, options=PlanOptions(overlap_degree=2))
    assert plan.num_stages == 2 and plan.ranks[0].num_remote_tokens == 0
    assert all(
        s.cast.input_split_sizes == (105,) and s.cast.dst_indices == ((),) for s in plan.ranks[0].stages
    )
    check_plan(plan, dense_mask(q, k, t, 105, 105))


def test_more_stages_than_overlap_chunks_gives_empty_stages() -> None:
    q, k, t = MASKS["varlen-causal"]
    plan = plan_attention(
        q, k, t, 105, 3, chunk_size=5, options=PlanOptions(overlap_degree=6, min_chunk_size=1000)
    )
    for rp in plan.ranks:
        sizes = [s.num_remote_tokens for s in rp.stages]
        assert len(sizes) == 6 and sizes[1:] == [0] * 5  # one overlap chunk: everything in stage 0
    check_plan(plan, dense_mask(q, k, t, 105, 105))


def test_plan_is_a_pure_hashable_value() -> None:
    q, k, t = MASKS["global-window"]
    a = plan_attention(
        q, k, t, 105, 5, chunk_size=7, options=PlanOptions(overlap_mode="dynamic", dynamic_max_degree=3)
    )
    b = plan_attention(
        q.to_list(),
        k.to_list(),
        [int(x) for x in t],
        105,
        5,
        chunk_size=7,
        options=PlanOptions(overlap_degree=None, dynamic_max_degree=3),
    )
    assert a == b and hash(a) == hash(b)
    assert a.transfer_matrix(0).sum() == sum(rp.stages[0].num_remote_tokens for rp in a.ranks)


def test_numpy_inputs_are_accepted() -> None:
    q = np.asarray([[0, 50], [50, 105]], dtype=np.int32)
    types = np.asarray([1, 0], dtype=np.int64)
    plan = solve_dispatch(q, q, types, 105, 3, 5)
    assert plan.rank_areas and sum(plan.chunk_areas) == 50 * 51 // 2 + 55 * 55


@pytest.mark.parametrize("fn", [magi_solver.solve_dispatch, magi_solver.plan_attention])
def test_public_docstrings_name_every_parameter(fn) -> None:
    doc = fn.__doc__ or ""
    for name in inspect.signature(fn).parameters:
        assert name in doc, f"{fn.__name__} docstring does not describe `{name}`"


def test_demo_runs_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo_main(["--total", "65536", "--docs", "40", "--chunk", "512", "--cp", "2", "8"]) == 0
    out = capsys.readouterr().out
    assert "all-gather" in out and out.count("|") > 10
    lens = varlen_doc_lengths(1000, 7, seed=3)
    assert sum(lens) == 1000 and min(lens) >= 1 and len(lens) == 7


def test_plan_reuses_a_given_dispatch() -> None:
    q1, k1, t1 = MASKS["varlen-causal"]
    q2, k2, t2 = MASKS["swa"]
    d1 = solve_dispatch(q1, k1, t1, 105, 5, 7)
    plan = plan_attention(
        q2, k2, t2, 105, 5, chunk_size=7, options=PlanOptions(overlap_degree=2, min_chunk_size=3), dispatch=d1
    )
    assert plan.dispatch.partitions == d1.partitions
    assert plan.dispatch.rank_areas != d1.rank_areas  # the new mask's costs
    check_plan(plan, dense_mask(q2, k2, t2, 105, 105))
    with pytest.raises(ValueError, match="dispatch"):
        plan_attention(q2, k2, t2, 105, 3, chunk_size=7, dispatch=d1)
    with pytest.raises(TypeError, match="dispatch"):
        plan_attention(q2, k2, t2, 105, 5, chunk_size=7, dispatch=d1.partitions)  # type: ignore[arg-type]
