"""The backward's dK/dV GroupReduce at overlap degree 0 sends the kernel's dtype (bf16 for bf16 inputs) and
sums into the owner's fp32 accumulator: the gradients are bit for bit those of widening to fp32 before
sending (what the runtime did before), and close to the fp64 reference. On gloo ranks, torch kernels."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from magi_attention.api import calc_attn, clear_cache, dispatch, magi_attn_flex_key, undispatch
from magi_attention.config import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_group_collective import GroupCastPlan, GroupReducePlan

TOTAL, HQ, HKV, D = 96, 4, 2, 16
# two causal documents and a full band across them: every rank holds keys that other ranks' queries read
Q_RANGES = [[0, 40], [40, 96], [48, 96]]
K_RANGES = [[0, 40], [40, 96], [0, 40]]
TYPES = [1, 1, 0]


def _grads(key, x: list[torch.Tensor], dout: torch.Tensor) -> list[torch.Tensor]:
    """dq, dk, dv (whole sequence, undispatched) of one calc_attn."""
    local = [dispatch(a, key).requires_grad_() for a in x]
    out, _ = calc_attn(*local, key)
    out.backward(dispatch(dout, key))
    return [undispatch(a.grad, key) for a in local]


def _degree0_worker(rank: int, world: int) -> int:
    g = torch.Generator().manual_seed(world)
    x = [torch.randn(TOTAL, h, D, generator=g).to(torch.bfloat16) for h in (HQ, HKV, HKV)]
    dout = torch.randn(TOTAL, HQ, D, generator=g).to(torch.bfloat16)
    xr = [a.double().requires_grad_() for a in x]
    out_ref, _ = ref_attn(*xr, make_attn_mask(Q_RANGES, K_RANGES, TYPES, TOTAL, TOTAL))
    out_ref.backward(dout.double())

    real_reduce = GroupReducePlan.reduce
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    widen = False

    def recording_reduce(self, input, output, *args, **kwargs):
        seen.append((input.dtype, output.dtype))
        return real_reduce(self, input.to(output.dtype) if widen else input, output, *args, **kwargs)

    real_cast = GroupCastPlan.cast
    casts: list[bool] = []

    def recording_cast(self, input, output, *args, **kwargs):
        # the received rows follow the own rows in the same storage
        behind = input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr() and (
            output.data_ptr() == input.data_ptr() + input.numel() * input.element_size()
        )
        casts.append(behind)
        return real_cast(self, input, output, *args, **kwargs)

    checks = 0
    GroupReducePlan.reduce = recording_reduce
    GroupCastPlan.cast = recording_cast
    try:
        for det in (False, True):
            config = DistAttnConfig(
                dispatch_config=DispatchConfig(chunk_size=8),
                overlap_config=OverlapConfig(degree=0),
                kernel_backend="torch",
                deterministic=det,
            )
            key = magi_attn_flex_key(
                Q_RANGES, K_RANGES, TYPES, TOTAL, TOTAL, HQ, HKV, D, dist.group.WORLD, config
            )
            widen, seen[:], casts[:] = False, [], []
            sent = _grads(key, x, dout)
            assert seen == [(torch.bfloat16, torch.float32)], f"degree 0 reduce got {seen}"
            assert casts == [True, True], f"forward / backward GroupCast outputs behind the own K/V: {casts}"
            widen = True
            widened = _grads(key, x, dout)  # the reduce of fp32 values: the runtime's earlier wire format
            for name, a, b, r in zip(("dq", "dk", "dv"), sent, widened, (t.grad for t in xr), strict=True):
                assert torch.equal(a, b), (
                    f"cp{world} deterministic={det}: {name} differs from the fp32 reduce"
                )
                err = ((a.double() - r).norm() / r.norm()).item()
                assert err < 1e-2, f"cp{world} deterministic={det}: {name} rel err {err:.2e} to fp64"
            checks += 1
    finally:
        GroupReducePlan.reduce = real_reduce
        GroupCastPlan.cast = real_cast
        clear_cache(dist.group.WORLD)
    return checks


@pytest.mark.parametrize("world", [2, 3], ids=["cp2", "cp3"])
def test_degree0_grad_reduce_sends_bf16_with_the_bits_of_fp32(world: int) -> None:
    assert run_distributed(_degree0_worker, world, timeout=300) == [2] * world
