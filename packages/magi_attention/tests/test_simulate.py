"""The plan's decomposition with the real kernel, all ranks in one process (no communication):
every rank's host and remote stages, merged through FFA's accumulate mode, equal dense fp64 attention.
The same function checks the Triton kernel in bf16 on a GPU (tests/gpu_runtime_worker.py, simulated cp 4 and 8)."""

from __future__ import annotations

import pytest
import torch

from magi_attention.simulate import simulate_dist_attn
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_solver import (
    PlanOptions,
    make_block_causal_mask,
    make_sliding_window_mask,
    make_varlen_causal_mask,
    plan_attention,
)

TOTAL, HQ, HKV, D = 384, 4, 2, 16

MASKS = {
    "varlen_causal": make_varlen_causal_mask([0, 100, 130, 300, TOTAL]),
    "swa": make_sliding_window_mask([0, 200, TOTAL], (40, 0)),
    "block_causal": make_block_causal_mask([0, 256, TOTAL], 64),
    "swa_bidirectional": make_sliding_window_mask([0, TOTAL], (30, 20)),
}


@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("cp", [3, 8])
@pytest.mark.parametrize("degree", [0, 1, 3])  # 0: one merged call per rank, as the runtime runs it
def test_simulated_ranks_match_dense(mask_name: str, cp: int, degree: int) -> None:
    mask = MASKS[mask_name]
    chunk = 16
    plan = plan_attention(
        mask.q_ranges,
        mask.k_ranges,
        mask.types,
        TOTAL,
        cp,
        chunk_size=chunk,
        options=PlanOptions(overlap_degree=degree, min_chunk_size=8),
    )
    gen = torch.Generator().manual_seed(cp * 10 + degree)
    q, k, v = (torch.randn(TOTAL, h, D, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV))
    do = torch.randn(TOTAL, HQ, D, dtype=torch.float64, generator=gen)
    out, lse, dq, dk, dv = simulate_dist_attn(q, k, v, do, plan, softcap=5.0)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    pairs = [[[r.start, r.end] for r in ranges] for ranges in (mask.q_ranges, mask.k_ranges)]
    dense = make_attn_mask(*pairs, [t.code for t in mask.types], TOTAL, TOTAL)
    out_ref, lse_ref = ref_attn(qr, kr, vr, dense, softcap=5.0)
    (out_ref * do).sum().backward()
    for name, got, ref in (
        ("out", out, out_ref),
        ("dq", dq, qr.grad),
        ("dk", dk, kr.grad),
        ("dv", dv, vr.grad),
    ):
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 1e-10, f"{name}: rel err {err:.2e}"
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite], lse_ref[finite], rtol=1e-12, atol=0)


def test_a_plan_grouped_by_node_matches_dense(monkeypatch) -> None:
    """cp 16 with the chosen dispatch (past one node its ranks are renumbered by node): every rank's share,
    run as the runtime runs it, still adds up to dense attention."""
    from magi_solver import PlanOptions, choice, plan_attention
    from magi_solver.choice import clear_dispatch_cache

    renumbered = []
    group = choice.group_by_node

    def spy(plan, traffic, node_size=8):
        out = group(plan, traffic, node_size)
        renumbered.append(out is not plan)
        return out

    monkeypatch.setattr(choice, "group_by_node", spy)
    clear_dispatch_cache()
    total, cp = 1024, 16
    mask = make_varlen_causal_mask([0, 100, 130, 300, 500, 620, 900, total])
    plan = plan_attention(
        mask.q_ranges, mask.k_ranges, mask.types, total, cp, options=PlanOptions(overlap_degree=0)
    )
    clear_dispatch_cache()
    assert any(renumbered)  # this mask's ranks were renumbered
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(total, h, D, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV, HQ))
    out, _, dq, dk, dv = simulate_dist_attn(q, k, v, do, plan)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    pairs = [[[r.start, r.end] for r in ranges] for ranges in (mask.q_ranges, mask.k_ranges)]
    dense = make_attn_mask(*pairs, [t.code for t in mask.types], total, total)
    out_ref, _ = ref_attn(*leaves, dense)
    (out_ref * do).sum().backward()
    for got, ref in ((out, out_ref), (dq, leaves[0].grad), (dk, leaves[1].grad), (dv, leaves[2].grad)):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-10
