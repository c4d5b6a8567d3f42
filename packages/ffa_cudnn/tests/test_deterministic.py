"""``deterministic=True`` on the cuDNN backend (its deterministic backward): four forward + backward runs give
the same bits on every mask (``gpu``-marked; the capability's statement is checked on the CPU)."""

from __future__ import annotations

import magi_ffa_cudnn
import pytest
import torch

from magi_ffa.testing import assert_bitwise_repeatable, deterministic_mask_cases
from magi_ffa.validation import check_slices

CASES = sorted(deterministic_mask_cases(64))


def test_capability_is_deterministic_on_every_mask() -> None:
    for qr, kr, tm in deterministic_mask_cases(256, seed=2).values():
        assert magi_ffa_cudnn.CAPABILITY.deterministic(check_slices(qr, kr, tm, 256, 256))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not magi_ffa_cudnn.cudnn_available(), reason="needs nvidia-cudnn-frontend")
@pytest.mark.filterwarnings("ignore:This static loop")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", CASES)
def test_deterministic_on_the_gpu(case: str, d: int) -> None:
    """bf16, GQA 8:2, 4k tokens: out, lse, dq, dk, dv bitwise equal over four runs."""
    total, hq, hk = 4096, 8, 2
    qr, kr, tm = deterministic_mask_cases(total, seed=3)[case]
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (
        torch.randn(total, h, d, generator=gen, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk)
    )
    assert_bitwise_repeatable(magi_ffa_cudnn.flex_flash_attn_func, q, k, v, qr, kr, tm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not magi_ffa_cudnn.cudnn_available(), reason="needs nvidia-cudnn-frontend")
@pytest.mark.filterwarnings("ignore:This static loop")
@pytest.mark.parametrize("case", CASES)
def test_deterministic_order_on_many_key_blocks(case: str) -> None:
    """16k tokens (128 key blocks a head, several write-order groups, 16:2 heads, d 128): the deterministic
    backward finishes, repeats its bits and differs from the default one only by the order of fp32 sums."""
    total, hq, hk, d = 16384, 16, 2, 128
    qr, kr, tm = deterministic_mask_cases(total, seed=5)[case]
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (
        torch.randn(total, h, d, generator=gen, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk)
    )
    do = torch.randn(q.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for det in (False, True, True):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = magi_ffa_cudnn.flex_flash_attn_func(*xs, qr, kr, tm, deterministic=det)[0]
        grads.setdefault(det, []).append(torch.autograd.grad(out, xs, do))
    (first, second), (default,) = grads[True], grads[False]
    for name, a, b, c in zip(("dq", "dk", "dv"), first, second, default):
        assert torch.equal(a, b), f"{name}: deterministic runs differ"
        scale = c.float().abs().max().item()
        diff = (a.float() - c.float()).abs().max().item()
        assert diff <= 2e-2 * scale, (
            f"{name}: deterministic differs from default by {diff:.3e} (max |x| {scale:.3e})"
        )
