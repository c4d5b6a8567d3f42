"""`DispatchConfig(uneven_shard=True)`: no padding, ranks hold different token counts, on gloo ranks in fp64.

Lengths not divisible by cp * chunk, random slice masks of all four types (overlapping ones included), every
dispatch algorithm and overlap degree: out, lse, dq, dk, dv against dense fp64; dispatch -> undispatch exact;
roll against torch.roll of the undispatched tensor; the key's per-rank lengths; cross-attention; a second
mask after dispatch; sinks, max logits and the lse gradient; pad_size and too-short sequences rejected on
every rank. One launch of the ranks per world size runs every case.
"""

from __future__ import annotations

import itertools
import os
import random
import zlib

import pytest
import torch
import torch.distributed as dist

import magi_attention.api as api
from magi_attention import DispatchConfig, DistAttnConfig, OverlapConfig, _layout
from magi_attention.simulate import simulate_dist_attn
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn, ref_max_logits
from magi_solver import PlanOptions, plan_attention

HQ, HKV, D = 4, 2, 8
RTOL = 1e-9


def _k_segment_slices(rng: random.Random, total: int, num: int):
    """Slices of all four types overlapping in q and in k, never sharing a (q, k) pair: the k axis is cut
    into disjoint segments, each taken by one or two slices with random, overlapping q ranges."""
    cuts = sorted(rng.sample(range(1, total), num - 1))
    bounds = [0, *cuts, total]
    q_ranges, k_ranges, types = [], [], []
    for ks, ke in itertools.pairwise(bounds):
        qs = rng.randrange(0, total - 10)
        qe = rng.randrange(qs + 1, min(total, qs + total // 2) + 1)
        q_ranges.append([qs, qe]), k_ranges.append([ks, ke]), types.append(rng.randrange(4))
        if qe < total - 1 and rng.random() < 0.5:
            qs2 = rng.randrange(qe, total - 1)
            q_ranges.append([qs2, rng.randrange(qs2 + 1, total + 1)])
            k_ranges.append([ks, ke]), types.append(rng.randrange(4))
    return q_ranges, k_ranges, types


def _shared_pairs(rng: random.Random, total: int, num: int):
    """Unconstrained random slices: they share (q, k) pairs; the mask is their union."""
    q_ranges, k_ranges = [], []
    for _ in range(num):
        qs, ks = rng.randrange(0, total - 1), rng.randrange(0, total - 1)
        q_ranges.append([qs, rng.randrange(qs + 1, total + 1)])
        k_ranges.append([ks, rng.randrange(ks + 1, total + 1)])
    return q_ranges, k_ranges, [rng.randrange(4) for _ in range(num)]


def _masks(total: int) -> dict:
    third = total // 3
    return {
        "random": _k_segment_slices(random.Random(total), total, 7),
        "shared_pairs": _shared_pairs(random.Random(total + 1), total, 5),
        "varlen_causal": ([[0, third], [third, total]], [[0, third], [third, total]], [1, 1]),
        "sliding_window": ([[0, 16], [16, total]], [[0, 16], [0, total]], [1, 3]),
        "inv_bi": ([[0, total], [5, total - 3]], [[0, total // 2], [total // 2, total]], [2, 3]),
    }


# (total, chunk): none of them is a multiple of chunk * cp for cp in 2..4, and the last chunk is short
GEOMETRIES = [(157, 8), (101, 6)]
CASES = [
    ("random", "min_heap", OverlapConfig(degree=0)),
    ("random", "min_heap", OverlapConfig(degree=2, min_chunk_size=4)),
    ("shared_pairs", "min_heap", OverlapConfig(degree=None, min_chunk_size=4)),
    ("varlen_causal", "zigzag", OverlapConfig(degree=1, min_chunk_size=4)),
    ("sliding_window", "sequential", OverlapConfig(degree=2, min_chunk_size=4)),
    ("inv_bi", "affinity", OverlapConfig(degree=1, min_chunk_size=4)),
]
SHIFTS = (1, -1, 9, -23, 200)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _config(chunk: int, alg: str = "min_heap", overlap: OverlapConfig | None = None) -> DistAttnConfig:
    return DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=chunk, alg=alg, uneven_shard=True),
        overlap_config=overlap or OverlapConfig(degree=1, min_chunk_size=4),
    )


def _check_layout(key, world_size: int, total: int, x: torch.Tensor) -> torch.Tensor:
    """Per-rank lengths, no padding, exact round trip, position ids; returns this rank's local x."""
    local = api.dispatch(x, key)
    lens = key.shard_seqlens
    assert sum(lens) == total and key.pad_size == 0 and key.uneven_shard
    assert local.shape[0] == key.shard_seqlen == lens[dist.get_rank()] == key.kv_shard_seqlen
    assert torch.equal(api.undispatch(local, key), x), "dispatch -> undispatch must be exact"
    pos = api.get_position_ids(key)
    assert pos.shape == (key.shard_seqlen,) and torch.equal(local, x[pos]), "position ids name local tokens"
    every = [None] * world_size
    dist.all_gather_object(every, pos.tolist())
    assert sorted(t for p in every for t in p) == list(range(total)), "every token on exactly one rank"
    return local


def _attention_worker(rank: int, world_size: int) -> list[str]:
    group = dist.group.WORLD
    done = []
    for total, chunk in GEOMETRIES:
        masks = _masks(total)
        for mask_name, alg, overlap in CASES:
            what = f"cp{world_size}/{total}/{mask_name}/{alg}/degree={overlap.degree}"
            q_ranges, k_ranges, types = masks[mask_name]
            key = api.magi_attn_flex_key(
                q_ranges, k_ranges, types, total, total, HQ, HKV, D, group, _config(chunk, alg, overlap)
            )
            gen = torch.Generator().manual_seed(zlib.crc32(what.encode()))
            q, k, v, do = (
                torch.randn(total, h, D, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV, HQ)
            )
            x = torch.randn(total, 3, dtype=torch.float64, generator=gen)
            local_x = _check_layout(key, world_size, total, x)
            if world_size > 1 and total % chunk:
                lens = key.shard_seqlens
                assert len(set(lens)) > 1 and max(lens) <= -(-total // (chunk * world_size)) * chunk, lens

            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out_local, meta = api.calc_attn(
                api.dispatch(qg, key), api.dispatch(kg, key), api.dispatch(vg, key), key
            )
            assert out_local.shape[0] == key.shard_seqlen
            out, lse = api.undispatch(out_local, key), api.undispatch(meta.lse, key)
            (out * do).sum().backward()

            mask = make_attn_mask(q_ranges, k_ranges, types, total, total)
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            out_ref, lse_ref = ref_attn(qr, kr, vr, mask)
            (out_ref * do).sum().backward()
            assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{what}: NaN"
            assert _rel(out, out_ref) < RTOL, f"{what}: out rel err {_rel(out, out_ref):.2e}"
            empty = torch.isinf(lse_ref)
            assert torch.equal(torch.isinf(lse), empty), f"{what}: lse -inf pattern"
            assert _rel(lse[~empty], lse_ref[~empty]) < RTOL, f"{what}: lse"
            for name, got, ref in (
                ("dq", qg.grad, qr.grad),
                ("dk", kg.grad, kr.grad),
                ("dv", vg.grad, vr.grad),
            ):
                assert _rel(got, ref) < RTOL, f"{what}: {name} rel err {_rel(got, ref):.2e}"

            # roll: torch.roll of the undispatched tensor, and its gradient the opposite roll
            w = torch.randn(total, 3, dtype=torch.float64, generator=gen)
            for shift in SHIFTS:
                xg = x.clone().requires_grad_()
                rolled = api.roll(api.dispatch(xg, key), shift, 0, key)
                assert torch.equal(api.undispatch(rolled.detach(), key), torch.roll(x, shift, 0)), shift
                (rolled * api.dispatch(w, key)).sum().backward()
                assert torch.allclose(xg.grad, torch.roll(w, -shift, 0), rtol=0, atol=1e-15), shift
            # along dim 1, with sanity checks on: ranks compare everything but the (uneven) token count
            os.environ["MAGI_ATTENTION_SANITY_CHECK"] = "1"
            try:
                rolled_t = api.roll(local_x.t().contiguous(), 5, 1, key).t()
            finally:
                del os.environ["MAGI_ATTENTION_SANITY_CHECK"]
            assert torch.equal(api.undispatch(rolled_t.contiguous(), key), torch.roll(x, 5, 0))
            done.append(what)
    return done


def _cross_worker(rank: int, world_size: int) -> list[str]:
    """total_q != total_k, neither padded: queries by area, keys and values in contiguous uneven shards."""
    done = []
    # (43, 7, 6): fewer key/value tokens than chunk_size * cp (their chunks shrink so every rank has one)
    for tq, tk, chunk in ((61, 37, 4), (43, 95, 6), (43, 7, 6)):
        for degree in (0, 2):
            what = f"cp{world_size} cross {tq}x{tk} degree={degree}"
            rng = random.Random(zlib.crc32(what.encode()))
            qr, kr, tm = [], [], []
            while len(qr) < 4:
                a, b = sorted(rng.randrange(tq + 1) for _ in range(2))
                c, d = sorted(rng.randrange(tk + 1) for _ in range(2))
                if a < b and c < d:
                    qr.append([a, b]), kr.append([c, d]), tm.append(rng.randrange(4))
            cfg = _config(chunk, overlap=OverlapConfig(degree=degree, min_chunk_size=4))
            key = api.magi_attn_flex_key(qr, kr, tm, tq, tk, HQ, HKV, D, dist.group.WORLD, cfg)
            assert sum(key.shard_seqlens) == tq and sum(key.kv_shard_seqlens) == tk and key.pad_size == 0
            gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
            q, do = (torch.randn(tq, HQ, D, dtype=torch.float64, generator=gen) for _ in range(2))
            k, v = (torch.randn(tk, HKV, D, dtype=torch.float64, generator=gen) for _ in range(2))
            local_k = api.dispatch_kv(k, key)
            assert local_k.shape[0] == key.kv_shard_seqlen
            assert torch.equal(api.undispatch_kv(local_k, key), k), what
            assert torch.equal(api.undispatch(api.dispatch(q, key), key), q), what
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out, meta = api.calc_attn(
                api.dispatch(qg, key), api.dispatch_kv(kg, key), api.dispatch_kv(vg, key), key
            )
            (api.undispatch(out, key) * do).sum().backward()
            qr_, kr_, vr_ = (t.clone().requires_grad_() for t in (q, k, v))
            ref, lse_ref = ref_attn(qr_, kr_, vr_, make_attn_mask(qr, kr, tm, tq, tk))
            (ref * do).sum().backward()
            assert _rel(api.undispatch(out.detach(), key), ref) < RTOL, what
            lse = api.undispatch(meta.lse, key)
            empty = torch.isinf(lse_ref)
            assert torch.equal(torch.isinf(lse), empty) and _rel(lse[~empty], lse_ref[~empty]) < RTOL, what
            for g, r, n in ((qg.grad, qr_.grad, "dq"), (kg.grad, kr_.grad, "dk"), (vg.grad, vr_.grad, "dv")):
                assert _rel(g, r) < RTOL, f"{what} {n}"
            done.append(what)
    return done


def _extras_worker(rank: int, world_size: int) -> str:
    """Sinks, max logits and the lse gradient; a second mask after dispatch; errors on every rank."""
    group = dist.group.WORLD
    total, chunk = 95, 7
    cu = [0, 40, total]
    key = api.magi_attn_varlen_key(cu, cu, HQ, HKV, D, group, causal=True, dist_attn_config=_config(chunk))
    gen = torch.Generator().manual_seed(world_size)
    q, k, v, do = (torch.randn(total, h, D, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV, HQ))
    dlse = torch.randn(total, HQ, dtype=torch.float64, generator=gen)
    sink = torch.randn(2, HQ, dtype=torch.float32, generator=gen)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    sg = sink.clone().requires_grad_()
    out, meta = api.calc_attn(
        api.dispatch(qg, key), api.dispatch(kg, key), api.dispatch(vg, key), key, softcap=3.0, sink=sg,
        return_max_logits=True,
    )  # fmt: skip
    loss = (api.undispatch(out, key) * do).sum() + (api.undispatch(meta.lse, key) * dlse).sum()
    loss.backward()
    mask = make_attn_mask([[0, 40], [40, total]], [[0, 40], [40, total]], [1, 1], total, total)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    sr = sink.double().requires_grad_()
    out_ref, lse_ref = ref_attn(qr, kr, vr, mask, softcap=3.0, sink=sr)
    ((out_ref * do).sum() + (lse_ref * dlse).sum()).backward()
    assert _rel(api.undispatch(out.detach(), key), out_ref) < RTOL
    assert _rel(api.undispatch(meta.lse.detach(), key), lse_ref) < RTOL
    for name, got, ref in (("dq", qg.grad, qr.grad), ("dk", kg.grad, kr.grad), ("dv", vg.grad, vr.grad)):
        assert _rel(got, ref) < RTOL, f"{name} rel err {_rel(got, ref):.2e}"
    dist.all_reduce(sg.grad, group=group)
    assert _rel(sg.grad, sr.grad) < 1e-6
    assert torch.allclose(meta.max_logits.double(), ref_max_logits(q, k, mask, softcap=3.0), atol=1e-6)

    # a sliding-window mask over the same uneven dispatch
    swa = api.make_varlen_key_for_new_mask_after_dispatch(cu, cu, key, causal=True, window_size=(5, 0))
    assert swa.shard_seqlens == key.shard_seqlens and torch.equal(
        api.get_position_ids(swa), api.get_position_ids(key)
    )
    out2, _ = api.calc_attn(api.dispatch(q, key), api.dispatch(k, key), api.dispatch(v, key), swa)
    q_r, k_r, t_r, _, _ = api.infer_attn_mask_from_cu_seqlens(cu, cu, causal=True, window_size=(5, 0))
    ref2, _ = ref_attn(q, k, v, make_attn_mask(q_r, k_r, [t.code for t in t_r], total, total))
    assert _rel(api.undispatch(out2, key), ref2) < RTOL

    # pad_size: 0 / None accepted, anything else refused on every rank (before any collective)
    args = ([[0, total]], [[0, total]], "causal", total, total, HQ, HKV, D, group, _config(chunk))
    assert api.magi_attn_flex_key(*args, pad_size=0).pad_size == 0
    padded = api.compute_pad_size(total, world_size, chunk)
    for bad in {3, padded} - {0}:
        with pytest.raises(ValueError, match="uneven_shard"):
            api.magi_attn_flex_key(*args, pad_size=bad)
    # fewer chunks than ranks: a clear error on every rank (no hang)
    if world_size > 1:
        with pytest.raises(ValueError, match="at least one chunk"):
            api.magi_attn_flex_key(
                [[0, 5]], [[0, 5]], 0, 5, 5, HQ, HKV, D, group, _config(5 // world_size + 3)
            )
    # a tensor of another rank's length is refused with the local length in the message
    with pytest.raises(ValueError, match=str(key.shard_seqlen)):
        api.undispatch(torch.zeros(key.shard_seqlen + 1, 2, dtype=torch.float64), key)
    # with every plan and length record gone, a key still reports its lengths, on one rank alone
    lens = key.shard_seqlens
    api.clear_cache()
    _layout._LENGTHS.clear()
    if rank == world_size - 1:
        assert key.shard_seqlens == lens and key.pad_size == 0
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"cp{w}")
def test_uneven_shard_matches_dense_fp64(world_size: int) -> None:
    for done in run_distributed(_attention_worker, world_size, timeout=400):
        assert len(done) == len(GEOMETRIES) * len(CASES)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"cp{w}")
def test_uneven_shard_cross_attention(world_size: int) -> None:
    for done in run_distributed(_cross_worker, world_size, timeout=300):
        assert len(done) == 6


@pytest.mark.parametrize("world_size", [1, 3], ids=lambda w: f"cp{w}")
def test_uneven_shard_sinks_new_mask_and_errors(world_size: int) -> None:
    assert run_distributed(_extras_worker, world_size, timeout=300) == ["ok"] * world_size


def _same_placement_worker(rank: int, world_size: int) -> bool:
    """A length the padded layout does not pad gives the very same token placement with uneven shards."""
    args = ([[0, 96]], [[0, 96]], "causal", 96, 96, HQ, HKV, D, dist.group.WORLD)
    even = api.magi_attn_flex_key(*args, DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=8)))
    uneven = api.magi_attn_flex_key(*args, _config(8))
    return torch.equal(api.get_position_ids(even), api.get_position_ids(uneven)) and even.shard_seqlens == (
        uneven.shard_seqlens
    )


def test_uneven_shard_without_a_short_chunk_is_the_padded_placement() -> None:
    assert all(run_distributed(_same_placement_worker, 3, timeout=120))


def test_simulated_uneven_plan_matches_dense() -> None:
    """The runtime's decomposition of an uneven plan with the real kernel, every rank in one process."""
    total = 149
    q_ranges, k_ranges, types = _masks(total)["random"]
    plan = plan_attention(
        q_ranges,
        k_ranges,
        types,
        total,
        3,
        chunk_size=8,
        options=PlanOptions(overlap_degree=2, min_chunk_size=4, uneven_shard=True),
    )
    assert len(set(plan.dispatch.shard_seqlens)) > 1
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(total, h, D, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV, HQ))
    out, lse, dq, dk, dv = simulate_dist_attn(q, k, v, do, plan)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = ref_attn(qr, kr, vr, make_attn_mask(q_ranges, k_ranges, types, total, total))
    (out_ref * do).sum().backward()
    for name, got, ref in (
        ("out", out, out_ref),
        ("dq", dq, qr.grad),
        ("dk", dk, kr.grad),
        ("dv", dv, vr.grad),
    ):
        assert _rel(got, ref) < 1e-10, name
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite) and _rel(lse[finite], lse_ref[finite]) < 1e-10


def test_dispatch_config_uneven_shard_validation() -> None:
    assert DispatchConfig().uneven_shard is False
    with pytest.raises(TypeError, match="uneven_shard"):
        DispatchConfig(uneven_shard=1)
    key = api.magi_attn_flex_key([[0, 10]], [[0, 10]], 0, 10, 10, HQ, HKV, D, None, _config(4))
    assert key.shard_seqlens == (10,) and key.shard_seqlen == 10 and key.pad_size == 0
