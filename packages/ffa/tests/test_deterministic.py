"""``deterministic=True`` through magi_ffa's ``flex_flash_attn_func`` (its Triton backend is deterministic on
every mask: each gradient block has one owner, no atomics). On the CPU under the interpreter at tiny sizes;
on a GPU at realistic ones (``gpu``-marked)."""

from __future__ import annotations

import os

import pytest
import torch

import magi_ffa
from magi_ffa.testing import assert_bitwise_repeatable, deterministic_mask_cases

CASES = sorted(deterministic_mask_cases(64))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU case needs TRITON_INTERPRET=1")
def test_triton_is_bitwise_repeatable_on_the_cpu(monkeypatch) -> None:
    monkeypatch.setenv("MAGI_FFA_BACKEND", "triton")
    total, hq, hk, d = 48, 2, 1, 16
    qr, kr, tm = deterministic_mask_cases(total, seed=1)["random_overlap"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, d, generator=gen) for h in (hq, hk, hk))
    assert_bitwise_repeatable(magi_ffa.flex_flash_attn_func, q, k, v, qr, kr, tm, runs=2)


def test_every_magi_ffa_backend_states_it_is_deterministic() -> None:
    from magi_ffa.contract import get_backend
    from magi_ffa.validation import check_slices

    checked = check_slices(*deterministic_mask_cases(64)["random_overlap"], 64, 64)
    for name in ("triton", "torch"):
        assert get_backend(name).capability.deterministic(checked)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", CASES)
def test_triton_is_bitwise_repeatable_on_the_gpu(case: str, d: int, monkeypatch) -> None:
    """Four forward + backward runs (bf16, GQA 8:2, 4k tokens) give the same bits."""
    monkeypatch.setenv("MAGI_FFA_BACKEND", "triton")
    total, hq, hk = 4096, 8, 2
    qr, kr, tm = deterministic_mask_cases(total, seed=3)[case]
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (
        torch.randn(total, h, d, generator=gen, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk)
    )
    assert_bitwise_repeatable(magi_ffa.flex_flash_attn_func, q, k, v, qr, kr, tm)
