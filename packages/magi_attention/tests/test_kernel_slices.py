"""The runtime's slices are checked once, when their tensors are built; its magi_ffa calls then skip the
slice checks (the FFA contract's entry on checked slices), while the public launchers keep them."""

from __future__ import annotations

import pytest
import torch

import magi_ffa.contract
from magi_attention._runtime.cache import RUNTIME_CACHE
from magi_attention._runtime.kernels import attn_kernel
from magi_attention.api import calc_attn, clear_cache, magi_attn_flex_key
from magi_attention.config import DistAttnConfig, KernelBackend
from magi_ffa.testing import make_attn_mask, ref_attn


def test_runtime_calls_use_the_slices_checked_at_build(monkeypatch) -> None:
    clear_cache()
    total, h, d = 32, 2, 8
    qr, kr, types = [[0, 16], [16, 32]], [[0, 16], [0, 32]], [1, 1]
    key = magi_attn_flex_key(qr, kr, types, total, total, h, h, d, None,
                             dist_attn_config=DistAttnConfig(kernel_backend="torch"))  # fmt: skip
    host = RUNTIME_CACHE.get(key).device_meta(torch.device("cpu")).host
    assert (host.checked.total_q, host.checked.total_k) == (total, total)
    assert len(host.checked.slices) > 0

    def unchecked(*args, **kwargs):
        raise AssertionError("the runtime re-checked its slices through the public launcher")

    # the mask-cache lookup (and slice checks) of every public entry of the FFA contract (a module global)
    monkeypatch.setattr(magi_ffa.contract, "checked_of", unchecked)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(total, h, d, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3)
    )
    out, _ = calc_attn(q, k, v, key)
    out.sum().backward()
    ref, _ = ref_attn(q.detach(), k.detach(), v.detach(), make_attn_mask(qr, kr, types, total, total))
    torch.testing.assert_close(out.detach(), ref)
    with pytest.raises(ValueError, match="checked for 32 query and 32 key tokens"):
        attn_kernel(KernelBackend.TORCH).fwd_slices(q.detach(), k.detach()[:8], v.detach()[:8], host)
    clear_cache()


def test_public_contract_launchers_keep_the_tables() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(16, 1, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    r = torch.tensor([[0, 16]], dtype=torch.int32)
    kernel = attn_kernel(KernelBackend.TORCH)
    out, _ = kernel.fwd(q, k, v, r, r, torch.ones(1, dtype=torch.int32))
    ref, _ = ref_attn(q, k, v, make_attn_mask([[0, 16]], [[0, 16]], [1], 16, 16))
    torch.testing.assert_close(out, ref)
