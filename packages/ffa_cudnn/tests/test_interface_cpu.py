"""Entry-point behaviour that needs no GPU: the install hint without cuDNN, input checks, head dims."""

from __future__ import annotations

import sys

import magi_ffa_cudnn
import pytest
import torch
from magi_ffa_cudnn import interface

BF = torch.bfloat16


@pytest.mark.skipif(magi_ffa_cudnn.cudnn_available(), reason="cuDNN's frontend is installed here")
@pytest.mark.parametrize("entry", ["flex_flash_attn_func", "ffa_fwd"])
def test_missing_cudnn_says_what_to_install(entry: str) -> None:
    x = torch.randn(4, 1, 8, dtype=BF)
    with pytest.raises(ImportError, match=r"nvidia-cudnn-frontend==1\.32\.0.*nvidia-cutlass-dsl\[cu13\]"):
        getattr(magi_ffa_cudnn, entry)(x, x, x, [[0, 4]], [[0, 4]])


@pytest.mark.skipif(magi_ffa_cudnn.cudnn_available(), reason="cuDNN's frontend is installed here")
def test_missing_cudnn_backward_says_what_to_install() -> None:
    x = torch.randn(4, 1, 8, dtype=BF)
    lse = torch.zeros(4, 1)
    with pytest.raises(ImportError, match=r"python scripts/install\.py cudnn"):
        magi_ffa_cudnn.ffa_bwd(x, x, x, x, x, lse, [[0, 4]], [[0, 4]])


def test_package_imports_without_cudnn() -> None:
    assert "magi_ffa_cudnn" in sys.modules
    if not magi_ffa_cudnn.cudnn_available():
        assert "cudnn.flex_attention" not in sys.modules


def test_head_dims() -> None:
    ok = [8, 16, 64, 72, 96, 128, 256]
    bad = [0, 4, 12, 136, 160, 192, 264, 512]
    assert all(magi_ffa_cudnn.head_dim_supported(d) for d in ok)
    assert not any(magi_ffa_cudnn.head_dim_supported(d) for d in bad)


def _args(**kw):
    args = {
        "q": torch.randn(4, 2, 8, dtype=BF),
        "k": torch.randn(4, 1, 8, dtype=BF),
        "v": torch.randn(4, 1, 8, dtype=BF),
        "softmax_scale": None,
        "softcap": 0.0,
        "out": None,
        "lse": None,
    }
    args.update(kw)
    return args


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        pytest.param({"q": "x"}, TypeError, "`q`", id="q-not-tensor"),
        pytest.param({"q": torch.randn(4, 8)}, ValueError, "`q` must be 3-D", id="q-2d"),
        pytest.param({"q": torch.randn(4, 2, 8)}, ValueError, "float16 or bfloat16", id="q-fp32"),
        pytest.param({"softmax_scale": -1.0}, ValueError, "softmax_scale", id="bad-scale"),
        pytest.param({"softcap": -1.0}, ValueError, "softcap", id="negative-softcap"),
        pytest.param({"softcap": 30.0}, ValueError, "`softcap` must be 0 on the cuDNN backend", id="softcap"),
        pytest.param(
            {
                "q": torch.randn(4, 2, 12, dtype=BF),
                "k": torch.randn(4, 1, 12, dtype=BF),
                "v": torch.randn(4, 1, 12, dtype=BF),
            },
            ValueError,
            "head_dim",
            id="head-dim-12",
        ),
        pytest.param({}, ValueError, "CUDA", id="cpu-tensors"),
    ],
)
def test_bad_inputs(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        interface.CAPABILITY.check_inputs(**_args(**kwargs))


def test_kernel_layout_copies_only_what_cudnn_cannot_read() -> None:
    base = torch.randn(8, 3, 2, 16, dtype=BF)
    packed_k = base[:, 1]  # a view into a fused K/V buffer: aligned strides, read in place
    assert interface._kernel_layout(packed_k).data_ptr() == packed_k.data_ptr()
    odd = torch.randn(8, 2, 17, dtype=BF)[..., :16]  # row stride 17: not 16-byte aligned -> a copy
    fixed = interface._kernel_layout(odd)
    assert fixed.is_contiguous() and torch.equal(fixed, odd)
    t = torch.randn(8, 2, 16, dtype=BF).transpose(0, 1)  # strides multiples of 8 elements: read in place
    assert interface._kernel_layout(t).data_ptr() == t.data_ptr()
