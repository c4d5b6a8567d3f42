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
