"""Cross-attention under context parallelism: queries from one sequence, keys and values from another of a
different length, both sharded over the cp group; out, lse, dq, dk, dv against dense fp64 (gloo ranks)."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
import torch.distributed as dist

import magi_attention.api as api
from magi_attention import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn

HQ, HKV, D = 4, 2, 8


def _mask(rng: random.Random, tq: int, tk: int):
    qr, kr, tm = [], [], []
    for _ in range(rng.randint(2, 8)):
        a, b = sorted(rng.randrange(tq + 1) for _ in range(2))
        c, d = sorted(rng.randrange(tk + 1) for _ in range(2))
        if a < b and c < d:
            qr.append([a, b])
            kr.append([c, d])
            tm.append(rng.randrange(4))
    return qr, kr, tm


CASES = [(61, 37), (40, 95), (33, 34)]
OVERLAPS = {
    "deg0": OverlapConfig(degree=0),
    "deg2": OverlapConfig(degree=2, min_chunk_size=4),
    "dyn": OverlapConfig(min_chunk_size=4),
}


def _worker(rank: int, world_size: int) -> list[str]:
    done = []
    for (tq, tk), (name, overlap) in [(c, o) for c in CASES for o in OVERLAPS.items()]:
        seed = zlib.crc32(f"{tq}/{tk}/{name}".encode())
        qr, kr, tm = _mask(random.Random(seed), tq, tk)
        config = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=4), overlap_config=overlap)
        key = api.magi_attn_flex_key(qr, kr, tm, tq, tk, HQ, HKV, D, dist.group.WORLD, config)
        assert key.is_cross_attention == (tq != tk)
        gen = torch.Generator().manual_seed(seed)
        q, do = (torch.randn(tq, HQ, D, dtype=torch.float64, generator=gen) for _ in range(2))
        k, v = (torch.randn(tk, HKV, D, dtype=torch.float64, generator=gen) for _ in range(2))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, meta = api.calc_attn(
            api.dispatch(qg, key), api.dispatch_kv(kg, key), api.dispatch_kv(vg, key), key
        )
        (api.undispatch(out, key) * do).sum().backward()
        qr_, kr_, vr_ = (t.clone().requires_grad_() for t in (q, k, v))
        ref, lse_ref = ref_attn(qr_, kr_, vr_, make_attn_mask(qr, kr, tm, tq, tk))
        (ref * do).sum().backward()
        what = f"cp{world_size} {tq}x{tk} {name}"
        got_out = api.undispatch(out.detach(), key)
        assert ((got_out - ref).norm() / ref.norm()).item() < 1e-10, what
        lse = api.undispatch(meta.lse, key)
        empty = torch.isinf(lse_ref)
        assert torch.equal(torch.isinf(lse), empty), what
        assert torch.allclose(lse[~empty], lse_ref[~empty], rtol=1e-10, atol=1e-10), what
        for g, r, n in ((qg.grad, qr_.grad, "dq"), (kg.grad, kr_.grad, "dk"), (vg.grad, vr_.grad, "dv")):
            assert ((g - r).norm() / r.norm().clamp_min(1e-300)).item() < 1e-10, f"{what} {n}"
        # the key/value shards round-trip
        assert torch.equal(api.undispatch_kv(api.dispatch_kv(k, key), key), k), what
        done.append(what)
    return done


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_cross_attention_matches_dense_fp64(world_size: int) -> None:
    for done in run_distributed(_worker, world_size, timeout=400):
        assert len(done) == len(CASES) * len(OVERLAPS)


def test_varlen_cross_documents() -> None:
    """Query document i attends key document i (causal: bottom-right diagonal)."""
    key = api.magi_attn_varlen_key([0, 5, 12], [0, 9, 20], HQ, HKV, D, None, causal=True)
    assert key.is_cross_attention and (key.total_seqlen_q, key.total_seqlen_k) == (12, 20)
    assert [tuple(r) for r in key.k_ranges] == [(0, 9), (9, 20)]
    with pytest.raises(ValueError, match="same number of documents"):
        api.magi_attn_varlen_key([0, 5, 12], [0, 20], HQ, HKV, D, None)
    windowed = api.magi_attn_varlen_key([0, 5, 12], [0, 9, 20], HQ, HKV, D, None, window_size=(3, 1))
    assert windowed.total_seqlen_k == 20 and len(windowed.q_ranges) >= 2
