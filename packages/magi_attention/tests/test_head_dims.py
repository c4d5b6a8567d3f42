"""head_dim 64, 128 and 256 through the whole runtime (dispatch, GroupCast of K/V, kernels, GroupReduce of
dK/dV), against dense fp64 attention, and the backend `auto` picks for each head_dim."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from magi_attention import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention._runtime.kernels import RankBackends, resolve
from magi_attention.api import calc_attn, dispatch, magi_attn_flex_key, undispatch
from magi_attention.config import KernelBackend
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn

HEAD_DIMS = (64, 128, 256)


def _worker(rank: int, world_size: int) -> list[tuple[int, int, float]]:
    total, hq, hkv = 96, 2, 1
    qr, kr, tm = [[0, 40], [40, 96], [50, 96]], [[0, 40], [0, 96], [10, 60]], [1, 1, 3]
    errors = []
    for d in HEAD_DIMS:
        for degree in (0, 1):
            config = DistAttnConfig(
                dispatch_config=DispatchConfig(chunk_size=8),
                overlap_config=OverlapConfig(degree=degree, min_chunk_size=8),
            )
            key = magi_attn_flex_key(qr, kr, tm, total, total, hq, hkv, d, dist.group.WORLD, config)
            gen = torch.Generator().manual_seed(d + degree)
            q, k, v, do = (
                torch.randn(total, h, d, dtype=torch.float64, generator=gen) for h in (hq, hkv, hkv, hq)
            )
            ins = [dispatch(t, key).requires_grad_() for t in (q, k, v)]
            out, _ = calc_attn(*ins, key)
            out.backward(dispatch(do, key))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, _ = ref_attn(*leaves, make_attn_mask(qr, kr, tm, total, total))
            (ref * do).sum().backward()
            got = [undispatch(out.detach(), key)] + [undispatch(x.grad, key) for x in ins]
            want = [ref.detach()] + [x.grad for x in leaves]
            err = max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))
            errors.append((d, degree, err))
    return errors


def test_head_dims_end_to_end_on_two_ranks() -> None:
    for errors in run_distributed(_worker, 2, timeout=300):
        assert {(d, deg) for d, deg, _ in errors} == {(d, deg) for d in HEAD_DIMS for deg in (0, 1)}
        for d, degree, err in errors:
            assert err < 1e-10, f"head_dim {d}, degree {degree}: rel err {err:.1e}"


@pytest.mark.parametrize(
    ("head_dim", "expected"), [(64, KernelBackend.FA4), (128, KernelBackend.FA4), (256, KernelBackend.TRITON)]
)
def test_auto_picks_triton_where_fa4_lacks_the_head_dim(head_dim: int, expected: KernelBackend) -> None:
    gpu = RankBackends("h200", ("fa4", "torch", "triton"))
    assert resolve(KernelBackend.AUTO, head_dim, [gpu, gpu]).backend == expected
