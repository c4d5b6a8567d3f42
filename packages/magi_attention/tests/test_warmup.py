"""magi_attention.warmup: runs the key's attention once (no user tensor touched), then calc_attn works; bad
arguments raise before any communication."""

from __future__ import annotations

import pytest
import torch

import magi_attention
from magi_attention import DistAttnConfig, KernelBackend, calc_attn, magi_attn_flex_key, warmup


def _key():
    config = DistAttnConfig(kernel_backend=KernelBackend.TORCH)
    return magi_attn_flex_key(
        [[0, 48], [48, 96]], [[0, 48], [0, 96]], ["causal", "causal"], 96, 96, 2, 1, 16, None, config
    )


def test_warmup_then_calc_attn() -> None:
    key = _key()
    state = torch.get_rng_state()
    assert magi_attention.warmup is warmup
    warmup(key, torch.float32, device="cpu")
    assert torch.equal(torch.get_rng_state(), state)  # the user's random stream is untouched
    q, k, v = (torch.randn(96, h, 16, requires_grad=True) for h in (2, 1, 1))
    out, _ = calc_attn(q, k, v, key)
    out.sum().backward()
    assert out.shape == (96, 2, 16) and torch.isfinite(out).all() and q.grad is not None


def test_warmup_rejects_bad_arguments() -> None:
    key = _key()
    with pytest.raises(TypeError, match="dtype must be one of"):
        warmup(key, torch.int32)
    with pytest.raises(TypeError, match="dtype must be one of"):
        warmup(key, "bfloat16")
    with pytest.raises(TypeError, match="key must be a DistAttnRuntimeKey"):
        warmup(object())


def _two_rank_worker(rank: int, world_size: int) -> float:
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    config = DistAttnConfig(kernel_backend=KernelBackend.TORCH)
    key = magi_attn_flex_key([[0, 64], [64, 128]], [[0, 64], [0, 128]], ["causal", "causal"], 128, 128, 2, 1, 16,
                             group, config)  # fmt: skip
    warmup(key, torch.float64)  # collective: every rank calls it
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 2, 16, generator=g, dtype=torch.float64)
    kv = torch.randn(128, 1, 16, generator=g, dtype=torch.float64)
    q, k, v = (magi_attention.dispatch(t, key) for t in (x, kv, kv.flip(0)))
    out, _ = calc_attn(q, k, v, key)
    return float(magi_attention.undispatch(out, key).sum())


def test_warmup_on_two_ranks() -> None:
    """Every rank of a cp group calls warmup, then the real call runs (the same value on every rank)."""
    from magi_attention.testing import run_distributed

    sums = run_distributed(_two_rank_worker, 2, timeout=300)
    assert len(sums) == 2 and sums[0] == pytest.approx(sums[1])
