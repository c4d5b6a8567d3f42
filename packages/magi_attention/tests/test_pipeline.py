"""End to end: flex key -> dispatch -> calc_attn -> undispatch, forward and backward, on gloo ranks.

Every result is compared with a single-process dense fp64 reference (magi_ffa.testing) at relative error
1e-9: out, lse, dq, dk, dv. One launch of the ranks per world size runs every (mask, overlap) case.
"""

from __future__ import annotations

import itertools
import random
import zlib

import pytest
import torch
import torch.distributed as dist

from magi_attention._runtime.cache import RUNTIME_CACHE
from magi_attention.api import calc_attn, dispatch, magi_attn_flex_key, undispatch
from magi_attention.config import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_group_collective import GroupCollectiveImpl

HQ, HKV, D = 4, 2, 8
RTOL = 1e-9


def k_segment_slices(total: int, num: int, seed: int):
    """Slices of all four types overlapping in q and in k (never sharing a (q, k) pair, which the
    union semantics forbids), some rows left with no keys.

    The k axis is cut into `num` disjoint segments; each slice takes one segment, and its q range is
    random, so q ranges overlap freely. A second slice per segment with a disjoint q range makes
    slices overlap in k too.
    """
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), num - 1))
    k_segments = list(itertools.pairwise([0, *cuts, total]))
    q_ranges, k_ranges, types = [], [], []
    for ks, ke in k_segments:
        qs = rng.randrange(0, total - 20)
        qe = rng.randrange(qs + 1, min(total, qs + total // 2) + 1)
        q_ranges.append([qs, qe])
        k_ranges.append([ks, ke])
        types.append(rng.randrange(4))
        if qe < total - 1 and rng.random() < 0.5:  # same keys, later disjoint queries
            qs2 = rng.randrange(qe, total - 1)
            q_ranges.append([qs2, rng.randrange(qs2 + 1, total + 1)])
            k_ranges.append([ks, ke])
            types.append(rng.randrange(4))
    return q_ranges, k_ranges, types


def shared_pair_slices(total: int, num: int, seed: int):
    """Unconstrained random slices: they share (q, k) pairs, and the mask is their union."""
    rng = random.Random(seed)
    q_ranges, k_ranges = [], []
    for _ in range(num):
        qs, ks = rng.randrange(0, total - 1), rng.randrange(0, total - 1)
        q_ranges.append([qs, rng.randrange(qs + 1, total + 1)])
        k_ranges.append([ks, rng.randrange(ks + 1, total + 1)])
    return q_ranges, k_ranges, [rng.randrange(4) for _ in range(num)]


def varlen(total: int, seed: int, causal: bool):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), 5))
    bounds = [0, *cuts, total]
    ranges = [[a, b] for a, b in itertools.pairwise(bounds)]
    return ranges, ranges, [1 if causal else 0] * len(ranges)


def sliding_window(total: int, window: int):
    """Causal sliding window over one document as CAUSAL wedge + BI_CAUSAL band."""
    q_ranges = [[0, window], [window, total]]
    k_ranges = [[0, window], [0, total]]
    return q_ranges, k_ranges, [1, 3]


def block_causal(total: int, block: int):
    q_ranges = [[s, min(s + block, total)] for s in range(0, total, block)]
    k_ranges = [[0, min(s + block, total)] for s in range(0, total, block)]
    return q_ranges, k_ranges, [0] * len(q_ranges)


def mask_cases(total: int):
    return {
        "random": k_segment_slices(total, 9, seed=7),
        "shared_pairs": shared_pair_slices(total, 6, seed=11),
        "varlen_causal": varlen(total, seed=3, causal=True),
        "varlen_full": varlen(total, seed=5, causal=False),
        "sliding_window": sliding_window(total, 24),
        "block_causal": block_causal(total, 40),
    }


OVERLAPS = {
    "od0": OverlapConfig(degree=0),
    "od1": OverlapConfig(degree=1, min_chunk_size=8),
    "od2": OverlapConfig(degree=2, min_chunk_size=8),
    "od3": OverlapConfig(degree=3, min_chunk_size=8),
    "dyn": OverlapConfig(degree=None, min_chunk_size=8),
}


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _check_lse(lse: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    empty = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), empty), f"{what}: lse -inf pattern differs from the reference"
    assert not torch.isnan(lse).any(), f"{what}: lse has NaN"
    err = _rel_err(lse[~empty], ref[~empty])
    assert err < RTOL, f"{what}: lse rel err {err:.2e}"


def _pipeline_worker(rank: int, world_size: int, total: int, chunk: int, case_names: list[tuple[str, str]]):
    group = dist.group.WORLD
    masks = mask_cases(total)
    for mask_name, overlap_name in case_names:
        what = f"cp{world_size}/{mask_name}/{overlap_name}"
        q_ranges, k_ranges, types = masks[mask_name]
        gen = torch.Generator().manual_seed(zlib.crc32(f"{mask_name}/{overlap_name}".encode()))
        q = torch.randn(total, HQ, D, dtype=torch.float64, generator=gen)
        k = torch.randn(total, HKV, D, dtype=torch.float64, generator=gen)
        v = torch.randn(total, HKV, D, dtype=torch.float64, generator=gen)
        do = torch.randn(total, HQ, D, dtype=torch.float64, generator=gen)
        config = DistAttnConfig(
            dispatch_config=DispatchConfig(chunk_size=chunk), overlap_config=OVERLAPS[overlap_name]
        )
        key = magi_attn_flex_key(q_ranges, k_ranges, types, total, total, HQ, HKV, D, group, config)

        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out_local, meta = calc_attn(dispatch(qg, key), dispatch(kg, key), dispatch(vg, key), key)
        out = undispatch(out_local, key)
        lse = undispatch(meta.lse, key)
        (out * do).sum().backward()

        mask = make_attn_mask(q_ranges, k_ranges, types, total, total)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out_ref, lse_ref = ref_attn(qr, kr, vr, mask)
        (out_ref * do).sum().backward()

        assert not torch.isnan(out).any(), f"{what}: out has NaN"
        assert _rel_err(out, out_ref) < RTOL, f"{what}: out rel err {_rel_err(out, out_ref):.2e}"
        _check_lse(lse, lse_ref, what)
        for name, got, ref in (("dq", qg.grad, qr.grad), ("dk", kg.grad, kr.grad), ("dv", vg.grad, vr.grad)):
            assert _rel_err(got, ref) < RTOL, f"{what}: {name} rel err {_rel_err(got, ref):.2e}"


ALL_CASES = [(m, o) for m in mask_cases(200) for o in OVERLAPS]


@pytest.mark.parametrize(
    ("world_size", "total", "chunk"),
    [
        pytest.param(1, 200, None, id="cp1"),
        pytest.param(2, 200, 10, id="cp2"),
        pytest.param(3, 200, 8, id="cp3-padded"),
        pytest.param(4, 200, 10, id="cp4"),
        pytest.param(5, 200, 8, id="cp5-padded"),
        pytest.param(8, 200, 5, id="cp8"),
    ],
)
def test_pipeline_matches_dense_fp64(world_size: int, total: int, chunk: int | None) -> None:
    run_distributed(_pipeline_worker, world_size, total, chunk, ALL_CASES)


def _mesh_worker(rank: int, world_size: int, total: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("inter", "intra"))
    masks = mask_cases(total)
    for mask_name in ("random", "varlen_causal", "block_causal"):
        q_ranges, k_ranges, types = masks[mask_name]
        gen = torch.Generator().manual_seed(zlib.crc32(mask_name.encode()))
        q = torch.randn(total, HQ, D, dtype=torch.float64, generator=gen)
        k = torch.randn(total, HKV, D, dtype=torch.float64, generator=gen)
        v = torch.randn(total, HKV, D, dtype=torch.float64, generator=gen)
        config = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=10), overlap_config=OVERLAPS["od2"])
        key = magi_attn_flex_key(q_ranges, k_ranges, types, total, total, HQ, HKV, D, mesh, config)
        assert key.cp_size == world_size and key.cp_group.mesh_shape == (2, world_size // 2)
        cast_plans = RUNTIME_CACHE.get(key).device_meta(torch.device("cpu")).cast_plans
        assert all(p.impl == GroupCollectiveImpl.HIERARCHICAL for p in cast_plans)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out_local, _ = calc_attn(dispatch(qg, key), dispatch(kg, key), dispatch(vg, key), key)
        out = undispatch(out_local, key)
        out.sum().backward()
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out_ref, _ = ref_attn(qr, kr, vr, make_attn_mask(q_ranges, k_ranges, types, total, total))
        out_ref.sum().backward()
        what = f"mesh 2x{world_size // 2}/{mask_name}"
        for name, got, ref in (
            ("out", out, out_ref),
            ("dq", qg.grad, qr.grad),
            ("dk", kg.grad, kr.grad),
            ("dv", vg.grad, vr.grad),
        ):
            assert _rel_err(got, ref) < RTOL, f"{what}: {name} rel err {_rel_err(got, ref):.2e}"


@pytest.mark.parametrize("world_size", [4], ids=["mesh2x2"])
def test_two_level_mesh_uses_hierarchical_collectives(world_size: int) -> None:
    """A 2-D (inter, intra) DeviceMesh: GroupCast/GroupReduce go hierarchical; results stay exact."""
    run_distributed(_mesh_worker, world_size, 200)


def _noncontiguous_worker(rank: int, world_size: int, total: int) -> None:
    """q, k, v as a framework hands them over: views into one fused QKV projection (strided heads) and a
    head-major buffer seen token-major (transposed strides). The result and the gradients equal those of
    contiguous copies of the same values."""
    from magi_attention._runtime import cache

    checks = []  # the runtime's slice checks: each kernel call's slices checked once, on first use
    check_slices = cache.check_slices
    cache.check_slices = lambda *a: checks.append(1) or check_slices(*a)
    group = dist.group.WORLD
    q_ranges, k_ranges, types = mask_cases(total)["random"]
    for overlap_name in ("od0", "od1"):
        checks.clear()
        config = DistAttnConfig(
            dispatch_config=DispatchConfig(chunk_size=8), overlap_config=OVERLAPS[overlap_name]
        )
        key = magi_attn_flex_key(q_ranges, k_ranges, types, total, total, HQ, HKV, D, group, config)
        gen = torch.Generator().manual_seed(zlib.crc32(overlap_name.encode()))
        x = torch.randn(total, HQ + 2 * HKV, D, dtype=torch.float64, generator=gen)
        do = torch.randn(total, HQ, D, dtype=torch.float64, generator=gen)
        # [shard, HQ + 2 HKV, D]: one buffer, three strided views (clones: dispatch at cp 1 returns its input)
        fused = dispatch(x, key).clone().requires_grad_()
        head_major = dispatch(x[:, HQ + HKV :], key).transpose(0, 1).contiguous().requires_grad_()
        q, k = fused[:, :HQ], fused[:, HQ : HQ + HKV]
        v = head_major.transpose(0, 1)  # [shard, HKV, D] with token stride D, head stride shard * D
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
        runtime = RUNTIME_CACHE.get(key)
        # dispatch reads only token indices: no GroupCast plan, no kernel slices built (nor checked) yet
        assert world_size == 1 or (not runtime._device_meta and not checks), (overlap_name, len(checks))
        out, meta = calc_attn(q, k, v, key)
        dlocal = dispatch(do, key)
        (out * dlocal).sum().backward()

        qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
        out_c, meta_c = calc_attn(qc, kc, vc, key)
        (out_c * dlocal).sum().backward()
        what = f"cp{world_size}/{overlap_name}"
        assert _rel_err(out, out_c) < 1e-12, f"{what}: out"
        assert torch.equal(torch.isinf(meta.lse), torch.isinf(meta_c.lse)), f"{what}: lse -inf pattern"
        finite = ~torch.isinf(meta_c.lse)
        assert _rel_err(meta.lse[finite], meta_c.lse[finite]) < 1e-12, f"{what}: lse"
        for name, got, ref in (
            ("dq", fused.grad[:, :HQ], qc.grad),
            ("dk", fused.grad[:, HQ : HQ + HKV], kc.grad),
            ("dv", head_major.grad.transpose(0, 1), vc.grad),
        ):
            assert _rel_err(got, ref) < 1e-12, f"{what}: {name}"
        assert not fused.grad[:, HQ + HKV :].any(), (
            f"{what}: the unused part of the fused buffer got a gradient"
        )
        # two forwards and backwards: degree 0 checks its merged call alone, else the host call and a call
        # per stage (cp 1: the whole mask), each once
        calls = 1 if world_size == 1 or runtime.merged_stage else 1 + runtime.num_stages
        assert len(checks) == calls, f"{what}: {len(checks)} slice checks, expected {calls}"
    cache.check_slices = check_slices


@pytest.mark.parametrize("world_size", [1, 3], ids=["cp1", "cp3"])
def test_non_contiguous_views_equal_contiguous_inputs(world_size: int) -> None:
    run_distributed(_noncontiguous_worker, world_size, 200)
