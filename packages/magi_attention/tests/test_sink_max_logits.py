"""calc_attn's attention sinks, max logits and differentiable lse on gloo ranks, against dense fp64.

One launch of the ranks per world size (1 to 4) runs every (mask, overlap degree) case: out, lse (with its
gradient), dq, dk, dv, dsink (each rank's sink.grad holds its own rows; their sum over ranks is the full
gradient, as DDP / FSDP would reduce it) and meta.max_logits (the same on every rank). A second launch runs
the Triton kernels under the interpreter (fp32) at cp 2.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from magi_attention.api import calc_attn, dispatch, magi_attn_flex_key, undispatch
from magi_attention.config import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn, ref_max_logits

HQ, HKV, D = 4, 2, 8
RTOL = 1e-9


def _masks(total: int) -> dict:
    third = total // 3
    return {
        # rows [0, 10) see no key: out 0, finite lse (sinks), no NaN anywhere
        "partial_causal": ([[10, total], [third, 2 * third]], [[0, total], [third, total]], [1, 2]),
        "varlen_causal": ([[0, third], [third, total]], [[0, third], [third, total]], [1, 1]),
        "sliding_window": ([[0, 24], [24, total]], [[0, 24], [0, total]], [1, 3]),
    }


OVERLAPS = {
    "od0": OverlapConfig(degree=0),
    "od1": OverlapConfig(degree=1, min_chunk_size=8),
    "od2": OverlapConfig(degree=2, min_chunk_size=8),
}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _worker(rank, world_size, total, chunk, dtype, backend, rtol, cases, d=D):
    group = dist.group.WORLD
    masks = _masks(total)
    for mask_name, overlap_name, use_sink, softcap in cases:
        what = f"cp{world_size}/{mask_name}/{overlap_name}/sink={use_sink}/softcap={softcap}"
        q_ranges, k_ranges, types = masks[mask_name]
        gen = torch.Generator().manual_seed(zlib.crc32(what.encode()))
        q, k, v, do = (
            torch.randn(total, h, d, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV, HQ)
        )
        dlse = torch.randn(total, HQ, dtype=torch.float64, generator=gen)
        sink = torch.randn(2, HQ, dtype=torch.float32, generator=gen) if use_sink else None
        config = DistAttnConfig(
            dispatch_config=DispatchConfig(chunk_size=chunk),
            overlap_config=OVERLAPS[overlap_name],
            kernel_backend=backend,
        )
        key = magi_attn_flex_key(q_ranges, k_ranges, types, total, total, HQ, HKV, d, group, config)

        qg, kg, vg = (t.clone().to(dtype).requires_grad_() for t in (q, k, v))
        sg = None if sink is None else sink.clone().requires_grad_()
        out_local, meta = calc_attn(
            dispatch(qg, key), dispatch(kg, key), dispatch(vg, key), key, softcap=softcap, sink=sg,
            return_max_logits=True,
        )  # fmt: skip
        out = undispatch(out_local, key)
        lse = undispatch(meta.lse, key)
        fin = torch.isfinite(lse)
        loss = (out.double() * do).sum() + (torch.where(fin, lse, 0).double() * dlse).sum()
        loss.backward()

        mask = make_attn_mask(q_ranges, k_ranges, types, total, total)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        sr = None if sink is None else sink.double().requires_grad_()
        out_ref, lse_ref = ref_attn(qr, kr, vr, mask, softcap=softcap, sink=sr)
        fin_ref = torch.isfinite(lse_ref)
        ((out_ref * do).sum() + (torch.where(fin_ref, lse_ref, 0) * dlse).sum()).backward()
        max_ref = ref_max_logits(q, k, mask, softcap=softcap)

        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{what}: NaN"
        assert torch.equal(fin, fin_ref), f"{what}: finite-lse pattern differs"
        if use_sink:
            assert fin.all(), f"{what}: with sinks every lse is finite"
            empty = ~mask.any(1)
            assert empty.any() == (mask_name == "partial_causal")
            assert torch.equal(out[empty], torch.zeros_like(out[empty])), f"{what}: empty rows not 0"
        assert _rel(out, out_ref) < rtol, f"{what}: out rel err {_rel(out, out_ref):.2e}"
        assert _rel(lse[fin], lse_ref[fin]) < rtol, f"{what}: lse rel err {_rel(lse[fin], lse_ref[fin]):.2e}"
        for name, got, ref in (("dq", qg.grad, qr.grad), ("dk", kg.grad, kr.grad), ("dv", vg.grad, vr.grad)):
            assert _rel(got, ref) < rtol, f"{what}: {name} rel err {_rel(got, ref):.2e}"
        if use_sink:
            local = sg.grad.clone()
            dist.all_reduce(sg.grad, group=group)  # what DDP / FSDP do with a replicated parameter
            assert sg.grad.dtype == torch.float32
            err = _rel(sg.grad, sr.grad)
            assert err < max(rtol, 1e-6), f"{what}: dsink rel err {err:.2e} (local part {local.tolist()})"
        mx = meta.max_logits
        assert mx.dtype == torch.float32 and mx.shape == (HQ,), f"{what}: max_logits {mx.dtype} {mx.shape}"
        assert torch.allclose(mx.double(), max_ref, rtol=1e-6, atol=1e-6), f"{what}: max {mx} vs {max_ref}"
        every = [torch.empty_like(mx) for _ in range(world_size)]
        dist.all_gather(every, mx, group=group)
        assert all(torch.equal(m, mx) for m in every), f"{what}: max_logits differ across ranks"


CASES = [
    (m, o, sink, softcap)
    for m in _masks(120)
    for o in OVERLAPS
    for sink, softcap in ((True, 0.0), (False, 0.0), (True, 2.5))
    if softcap == 0.0 or o == "od1"
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"cp{w}")
def test_sinks_max_logits_lse_grad_fp64(world_size: int) -> None:
    run_distributed(_worker, world_size, 120, 8, torch.float64, "torch", RTOL, CASES, timeout=300)


def test_triton_kernels_fp32_cp2() -> None:
    """The runtime on the Triton kernels (interpreter): the sink fused into the kernel, max logits from it."""
    cases = [("partial_causal", "od1", True, 0.0), ("sliding_window", "od0", True, 2.5)]
    run_distributed(_worker, 2, 64, 8, torch.float32, "triton", 2e-5, cases, 16, timeout=300)
