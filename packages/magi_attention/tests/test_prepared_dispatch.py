"""A new mask's dispatch solved ahead in a data-loader worker (`prepare_varlen_dispatch`) and adopted by the
training process (`adopt_dispatch`): the key takes it without solving, and the results equal dense fp64
attention; a rank that does not adopt solves the same placement itself."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from magi_attention import api
from magi_attention import config as cfg
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_solver import long_tailed_cu_seqlens

TOTAL, HQ, HKV, D = 1536, 2, 1, 8
STEPS = 3


class _Masks(torch.utils.data.Dataset):
    """One packed-documents batch per step, new lengths each time; the worker prepares its dispatch."""

    def __init__(self, cp: int):
        self.cp = cp

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, step: int):
        cu = [int(x) for x in long_tailed_cu_seqlens(TOTAL, seed=step)]
        return cu, api.prepare_varlen_dispatch(cu, cu, self.cp, causal=True)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _worker(rank: int, world_size: int, batches: list) -> str:
    import magi_solver.choice as choice_mod

    adopts = rank != world_size - 1  # the last rank solves for itself: the same placement
    if adopts:

        def no_solve(*args, **kwargs):
            raise AssertionError("the key solved a dispatch that was prepared and adopted")

        choice_mod._choose = no_solve
    group = dist.group.WORLD
    for cu, prepared in batches:
        if adopts:
            api.adopt_dispatch(prepared)
        key = api.magi_attn_varlen_key(cu, cu, HQ, HKV, D, group, causal=True)
        assert api.get_dispatch_choice(key).algorithm == prepared.choice.algorithm
        gen = torch.Generator().manual_seed(len(cu))
        q, k, v, do = (
            torch.randn(TOTAL, h, D, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV, HQ)
        )
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out_local, _ = api.calc_attn(api.dispatch(qg, key), api.dispatch(kg, key), api.dispatch(vg, key), key)
        out = api.undispatch(out_local, key)
        (out * do).sum().backward()
        ranges = [list(r) for r in itertools.pairwise(cu)]
        mask = make_attn_mask(ranges, ranges, [1] * len(ranges), TOTAL, TOTAL)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out_ref, _ = ref_attn(qr, kr, vr, mask)
        (out_ref * do).sum().backward()
        assert _rel(out, out_ref) < 1e-9
        for got, ref in ((qg.grad, qr.grad), (kg.grad, kr.grad), (vg.grad, vr.grad)):
            assert _rel(got, ref) < 1e-9
    api.clear_cache(group)
    return "ok"


def test_dispatch_prepared_in_a_loader_worker_is_adopted() -> None:
    # the loader's worker process solves each step's dispatch; the ranks (forked here) get what it sent
    loader = torch.utils.data.DataLoader(_Masks(3), batch_size=None, num_workers=1)
    batches = list(loader)
    assert run_distributed(_worker, 3, batches, timeout=300) == ["ok"] * 3


def test_prepared_equals_the_keys_own_solve() -> None:
    cu = [0, 700, 1100, 2048]
    conf = cfg.DistAttnConfig(dispatch_config=cfg.DispatchConfig(alg="documents"))
    a = api.prepare_varlen_dispatch(cu, cu, 4, causal=True, dist_attn_config=conf)
    b = api.prepare_flex_dispatch([(0, 700), (700, 1100), (1100, 2048)], [(0, 700), (700, 1100), (1100, 2048)],
                                  "causal", 2048, 2048, 4, conf)  # fmt: skip
    assert a == b and a.choice.algorithm == "documents" and a.plan.cp_size == 4
    assert api.prepare_varlen_dispatch(cu, cu, 4, causal=True, chunk_size=128).plan.chunk_size == 128
    # cross-attention: the chunk dispatch over the query sequence (the documents placement is self-attention only)
    cross = api.prepare_varlen_dispatch(cu, [0, 300, 700, 1000], 2)
    assert cross.choice.algorithm != "documents" and cross.plan.cp_size == 2 and cross.request[-1]


def test_prepare_refuses_bad_arguments_by_name() -> None:
    cu = [0, 512, 1024]
    with pytest.raises(ValueError, match="cp_size"):
        api.prepare_varlen_dispatch(cu, cu, 0)
    with pytest.raises(TypeError, match="dist_attn_config"):
        api.prepare_varlen_dispatch(cu, cu, 2, dist_attn_config={"chunk_size": 64})
    with pytest.raises(ValueError, match="k_ranges"):
        api.prepare_flex_dispatch([(0, 512)], [(0, 2048)], "full", 1024, 1024, 2)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        api.prepare_varlen_dispatch([5, 10], [5, 10], 2)
    with pytest.raises(TypeError, match="prepared"):
        api.adopt_dispatch(object())


def test_a_solve_elsewhere_and_a_placement_no_solve_makes() -> None:
    from magi_attention.testing import moved_to_next_rank, solved_elsewhere, token_ids_on_rank

    cu = long_tailed_cu_seqlens(3000, seed=5)
    here = api.prepare_varlen_dispatch(cu, cu, 3, causal=True)
    there = solved_elsewhere(api.prepare_varlen_dispatch, cu, cu, 3, causal=True)
    assert there.request == here.request and there.plan == here.plan  # a pure function of its arguments
    moved = moved_to_next_rank(there)
    parts = here.plan.partitions
    assert moved.plan.partitions == (parts[2], parts[0], parts[1]) and moved.request == here.request
    assert sum(moved.plan.rank_areas) == sum(here.plan.rank_areas)
    api.adopt_dispatch(moved)  # a valid placement: adoptable
    # the tokens a key that took it holds: rank r's of `here` now on rank r + 1, padding as the last token
    held = [token_ids_on_rank(moved, r) for r in range(3)]
    assert held[1] == token_ids_on_rank(here, 0) and held[0] == token_ids_on_rank(here, 2)
    assert sorted({t for ids in held for t in ids}) == list(range(cu[-1]))
