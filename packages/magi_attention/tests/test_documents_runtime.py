"""The documents placement through the runtime on gloo, where its balance polish moves chunks: an exact
dispatch permutation, position ids, and forward, lse and gradients equal to dense fp64 attention."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from magi_attention import api
from magi_attention import config as cfg
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_solver import long_tailed_cu_seqlens, make_varlen_causal_mask

TOTAL, HQ, HKV, D = 2048, 2, 1, 8
RTOL = 1e-9


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _polish_moves_chunks(cu: list[int], cp: int) -> bool:
    """Whether the placement's balance polish changes this pack's plan at `cp` (the test covers it)."""
    import magi_solver.documents as documents
    from magi_solver.kernel_law import law_for_mask
    from magi_solver.mask import normalize_mask

    sl = normalize_mask(*make_varlen_causal_mask(cu), TOTAL, TOTAL)
    law = law_for_mask(sl, TOTAL)
    with_polish = documents.documents_plans(sl, TOTAL, cp, law)[0].chunk_owner
    real = documents._POLISH
    try:
        documents._POLISH = False
        without = documents.documents_plans(sl, TOTAL, cp, law)[0].chunk_owner
    finally:
        documents._POLISH = real
    return with_polish != without


def _worker(rank: int, world_size: int, cu: list[int]) -> str:
    for causal in (True, False):
        _check(world_size, cu, causal)
    api.clear_cache(dist.group.WORLD)
    return "ok"


def _check(world_size: int, cu: list[int], causal: bool) -> None:
    group = dist.group.WORLD
    conf = cfg.DistAttnConfig(
        dispatch_config=cfg.DispatchConfig(alg="documents"), overlap_config=cfg.OverlapConfig(degree=0)
    )
    key = api.magi_attn_varlen_key(cu, cu, HQ, HKV, D, group, causal=causal, dist_attn_config=conf)
    assert api.get_dispatch_choice(key).algorithm == "documents"
    gen = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(TOTAL, h, D, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV, HQ))
    local = api.dispatch(q, key)
    assert torch.equal(api.undispatch(local, key), q), "dispatch -> undispatch must be exact"
    real = api.dispatch(torch.ones(TOTAL, 1, dtype=torch.float64), key)[:, 0] != 0  # padding rows are zeros
    pos = api.get_position_ids(key)[real]
    every = [None] * world_size
    dist.all_gather_object(every, pos.tolist())
    assert sorted(t for p in every for t in p) == list(range(TOTAL)), "every token once"

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out_local, meta = api.calc_attn(api.dispatch(qg, key), api.dispatch(kg, key), api.dispatch(vg, key), key)
    out, lse = api.undispatch(out_local, key), api.undispatch(meta.lse, key)
    (out * do).sum().backward()
    ranges = [list(r) for r in itertools.pairwise(cu)]
    mask = make_attn_mask(ranges, ranges, [1 if causal else 0] * len(ranges), TOTAL, TOTAL)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = ref_attn(qr, kr, vr, mask)
    (out_ref * do).sum().backward()
    assert _rel(out, out_ref) < RTOL and _rel(lse, lse_ref) < RTOL
    for got, ref in ((qg.grad, qr.grad), (kg.grad, kr.grad), (vg.grad, vr.grad)):
        assert _rel(got, ref) < RTOL


@pytest.mark.parametrize(("world_size", "seed"), [(3, 0), (4, 0)], ids=["cp3", "cp4"])
def test_polished_placement_matches_dense(world_size: int, seed: int) -> None:
    cu = [int(x) for x in long_tailed_cu_seqlens(TOTAL, seed=seed)]
    if world_size == 3:  # the case where the polish moves chunks: the runtime sees its plan
        assert _polish_moves_chunks(cu, world_size)
    assert run_distributed(_worker, world_size, cu, timeout=300) == ["ok"] * world_size
