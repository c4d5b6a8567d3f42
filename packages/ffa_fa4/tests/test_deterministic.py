"""``deterministic=True`` on the FA4 backend: bitwise repeatable on masks that take FA4's varlen path (its
deterministic backward), refused with a ValueError naming the mask kind and the backends that can, before any
kernel starts, on masks that take the block-sparse path (FA4 4.0.0b36 has no deterministic block-sparse
backward). The refusal and ``deterministic_supported`` run on the CPU (FA4 replaced by a fake that fails if
called); the repeatability runs on a GPU (``gpu``-marked)."""

from __future__ import annotations

import pytest
import torch

import magi_ffa_fa4
from magi_ffa.testing import assert_bitwise_repeatable, deterministic_mask_cases
from magi_ffa_fa4 import interface

CASES = sorted(deterministic_mask_cases(64))
REFUSAL = r'FA4 backend.*"block-sparse" path.*`cudnn`.*`triton`'


def test_deterministic_supported_says_which_path_a_mask_takes() -> None:
    cases = deterministic_mask_cases(4096, seed=3)
    assert magi_ffa_fa4.deterministic_supported(*cases["packed_docs"], 4096, 4096)
    assert magi_ffa_fa4.deterministic_supported(*cases["sliding_window"], 4096, 4096)
    assert not magi_ffa_fa4.deterministic_supported(*cases["random_overlap"], 4096, 4096)
    assert magi_ffa_fa4.deterministic_supported([], [], [], 16, 16)  # nothing to compute
    with pytest.raises(ValueError, match="q_ranges"):
        magi_ffa_fa4.deterministic_supported([[0, 17]], [[0, 16]], [0], 16, 16)


def test_block_sparse_mask_is_refused_before_any_kernel(monkeypatch) -> None:
    def no_kernel():
        raise AssertionError("an FA4 kernel was reached")

    monkeypatch.setattr(interface, "_fa4", lambda: None)  # "installed"
    monkeypatch.setattr(interface, "get_launch_meta", lambda *a, **k: no_kernel())
    relaxed = interface.relaxed_capability(architectures="any", device="any")
    monkeypatch.setattr(interface.BACKEND, "capability", relaxed)
    total = 512
    qr, kr, tm = deterministic_mask_cases(total, seed=3)["random_overlap"]
    q, k, v = (torch.randn(total, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    with pytest.raises(ValueError, match=REFUSAL):
        magi_ffa_fa4.flex_flash_attn_func(q, k, v, qr, kr, tm, deterministic=True)
    with pytest.raises(ValueError, match=REFUSAL):
        magi_ffa_fa4.ffa_fwd(q, k, v, qr, kr, tm, deterministic=True)
    lse = torch.zeros(total, 4)
    with pytest.raises(ValueError, match=REFUSAL):
        magi_ffa_fa4.ffa_bwd(q, q, k, v, q, lse, qr, kr, tm, deterministic=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not magi_ffa_fa4.fa4_available(), reason="needs flash-attn-4")
@pytest.mark.filterwarnings("ignore:Argument aux_data")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", CASES)
def test_deterministic_on_the_gpu(case: str, d: int) -> None:
    """Four forward + backward runs (bf16, GQA 8:2, 4k tokens) give the same bits on the varlen masks; the
    random overlapping slices (block-sparse) are refused before any kernel starts."""
    total, hq, hk = 4096, 8, 2
    qr, kr, tm = deterministic_mask_cases(total, seed=3)[case]
    gen = torch.Generator(device="cuda").manual_seed(d)
    q, k, v = (
        torch.randn(total, h, d, generator=gen, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk)
    )
    if case == "random_overlap":
        assert not magi_ffa_fa4.deterministic_supported(qr, kr, tm, total, total)
        with pytest.raises(ValueError, match=REFUSAL):
            magi_ffa_fa4.flex_flash_attn_func(q, k, v, qr, kr, tm, deterministic=True)
        return
    assert magi_ffa_fa4.deterministic_supported(qr, kr, tm, total, total)
    assert_bitwise_repeatable(magi_ffa_fa4.flex_flash_attn_func, q, k, v, qr, kr, tm)
