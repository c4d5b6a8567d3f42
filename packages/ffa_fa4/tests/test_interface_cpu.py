"""Entry-point behaviour that needs no GPU: the install hint without FA4, input checks, plan cache keys."""

from __future__ import annotations

import pytest
import torch

import magi_ffa
import magi_ffa_fa4
from magi_ffa_fa4 import interface


@pytest.mark.skipif(magi_ffa_fa4.fa4_available(), reason="flash-attn-4 is installed here")
def test_missing_fa4_says_what_to_install() -> None:
    x = torch.randn(4, 1, 8)
    with pytest.raises(ImportError, match=r"flash-attn-4==4\.0\.0b36.*nvidia-cutlass-dsl\[cu13\]"):
        magi_ffa_fa4.flex_flash_attn_func(x, x, x, [[0, 4]], [[0, 4]])


def test_package_imports_without_fa4() -> None:
    import sys

    assert "magi_ffa_fa4" in sys.modules
    if not magi_ffa_fa4.fa4_available():
        assert "flash_attn" not in sys.modules or sys.modules["flash_attn"] is None


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        pytest.param({"q": "x"}, TypeError, "`q`", id="q-not-tensor"),
        pytest.param({"q": torch.randn(4, 8)}, ValueError, "`q` must be 3-D", id="q-2d"),
        pytest.param({"q": torch.randn(4, 2, 8)}, ValueError, "float16 or bfloat16", id="q-fp32"),
        pytest.param({"softmax_scale": -1.0}, ValueError, "softmax_scale", id="bad-scale"),
        pytest.param({"softcap": -1.0}, ValueError, "softcap", id="bad-softcap"),
    ],
)
def test_bad_inputs(kwargs, exc, match) -> None:
    args = {
        "q": torch.randn(4, 2, 8, dtype=torch.bfloat16),
        "k": torch.randn(4, 1, 8, dtype=torch.bfloat16),
        "v": torch.randn(4, 1, 8, dtype=torch.bfloat16),
        "softmax_scale": None,
        "softcap": 0.0,
        "out": None,
        "lse": None,
    }
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        interface.CAPABILITY.check_inputs(**args)


def test_cpu_tensors_rejected_and_heads_checked() -> None:
    bf = torch.bfloat16
    with pytest.raises(ValueError, match="CUDA"):
        interface.CAPABILITY.check_inputs(
            torch.randn(4, 2, 8, dtype=bf),
            torch.randn(4, 1, 8, dtype=bf),
            torch.randn(4, 1, 8, dtype=bf),
            None,
            0.0,
            None,
            None,
        )


def test_merge_matches_union_softmax() -> None:
    # merging two partial (out, lse) equals attention over the union of their keys; -inf rows stay 0/-inf
    torch.manual_seed(0)
    s = torch.randn(5, 3, 12, dtype=torch.float64)
    v = torch.randn(5, 3, 12, 4, dtype=torch.float64)
    s[0, :, :6] = float("-inf")
    s[1] = float("-inf")

    def part(cols):
        lse = torch.logsumexp(s[..., cols], -1)
        p = torch.exp(s[..., cols] - torch.where(torch.isinf(lse), 0, lse)[..., None])
        return (p[..., None] * v[..., cols, :]).sum(-2), lse

    o1, l1 = part(slice(0, 6))
    o2, l2 = part(slice(6, 12))
    o, l = interface._merge_differentiable(o1, l1, o2, l2)
    ow, lw = part(slice(0, 12))
    assert torch.allclose(l, lw) and torch.allclose(o.double(), ow.float().double(), atol=1e-6)
    assert bool(torch.isneginf(l[1]).all()) and bool((o[1] == 0).all())


def test_autograd_merge_ignores_garbage_out_on_empty_rows() -> None:
    """Regression: the autograd path's merge (a torch copy of magi_ffa's) multiplied the accumulator's out by
    its weight, exp(-inf) = 0, so a NaN left in a row that had seen no key yet survived (NaN * 0 = NaN).
    It is magi_ffa's merge now, which selects such rows away instead."""
    assert interface._merge_differentiable is magi_ffa.merge_out_lse
    torch.manual_seed(0)
    acc = torch.full((3, 2, 4), float("nan"))
    acc_lse = torch.full((3, 2), float("-inf"))
    new, new_lse = torch.randn(3, 2, 4), torch.randn(3, 2)
    new_lse[2] = float("-inf")  # a row no partial has seen: stays out 0 / lse -inf
    new[2] = float("nan")
    o, l = interface._merge_differentiable(acc, acc_lse, new, new_lse)
    assert not torch.isnan(o).any(), "a NaN in a -inf row leaked into the merged output"
    torch.testing.assert_close(o[:2], new[:2])
    torch.testing.assert_close(l[:2], new_lse[:2])
    assert bool((o[2] == 0).all()) and bool(torch.isneginf(l[2]).all())


def test_plan_cache_keys_by_value_and_tracks_in_place_edits(monkeypatch) -> None:
    from magi_ffa_fa4 import _launch_meta

    built = []

    def fake_build(qr, kr, tm, total_q, total_k, device):
        built.append((qr.tolist(), kr.tolist(), tm.tolist()))
        return object()

    monkeypatch.setattr(_launch_meta, "build_launch_meta", fake_build)
    _launch_meta.clear_launch_cache()
    cpu = torch.device("cpu")
    qr = torch.tensor([[0, 8]], dtype=torch.int32)
    kr = torch.tensor([[0, 8]], dtype=torch.int32)
    a = _launch_meta.get_launch_meta(qr, kr, None, 8, 8, cpu)
    assert _launch_meta.get_launch_meta(qr, kr, None, 8, 8, cpu) is a  # same tensors: identity path
    assert _launch_meta.get_launch_meta([[0, 8]], [[0, 8]], [0], 8, 8, cpu) is a  # same values, other objects
    assert (
        _launch_meta.get_launch_meta(qr.clone(), kr.clone(), torch.zeros(1, dtype=torch.int64), 8, 8, cpu)
        is a
    )
    qr[0, 1] = 6  # in-place edit bumps the version counter: the identity entry must not be reused
    b = _launch_meta.get_launch_meta(qr, kr, None, 8, 8, cpu)
    assert b is not a and built[-1][0] == [[0, 6]]
    assert _launch_meta.get_launch_meta(qr, kr, [1], 8, 8, cpu) is not b  # type map is part of the key
    assert _launch_meta.get_launch_meta([[0, 6]], [[0, 8]], None, 8, 9, cpu) is not b  # so are the sizes
    assert len(built) == 4
    with pytest.raises(ValueError, match="q_ranges"):
        _launch_meta.get_launch_meta([[0, 9]], [[0, 8]], None, 8, 8, cpu)
    _launch_meta.clear_launch_cache()


def test_public_docstrings_name_every_parameter() -> None:
    import inspect

    from magi_ffa_fa4 import block_classes, build_block_meta, row_intervals, row_intervals_reference

    for fn in (magi_ffa_fa4.flex_flash_attn_func, block_classes, build_block_meta, row_intervals_reference):
        doc = inspect.getdoc(fn) or ""
        for name in inspect.signature(fn).parameters:
            assert f"{name}:" in doc or f"{name}," in doc, f"{fn.__name__}: `{name}` missing from docstring"
    assert "use_triton" in (inspect.getdoc(row_intervals) or "")
