"""The vendor calls of ``info --bench`` and the benchmarks express the standard masks correctly.

On the CPU, PyTorch's FlexAttention runs eagerly (``torch.compile`` is swapped for the eager function), so
the block masks it builds from each standard mask are checked against dense float64 attention on the same
slices; the masks run one after the other in one process, as ``--bench`` calls them.
"""

from __future__ import annotations

import pytest
import torch

from magi_attention._runtime import vendor_kernels
from magi_ffa.testing import make_attn_mask, random_qkv, ref_attn


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_call_matches_dense_reference_on_every_standard_mask(monkeypatch) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    def eager(q, k, v, **kw):  # FlexAttention has no CPU backward: the forward on detached leaves
        return flex_attention(q.detach(), k.detach(), v.detach(), **kw)

    monkeypatch.setattr(vendor_kernels, "_FLEX", {"fn": eager})
    total = 256
    q, k, v = random_qkv(total, total, 2, 2, 16, torch.float32, "cpu", seed=3)
    masks = vendor_kernels.standard_masks(total, window=total // 4)
    assert [m.name for m in masks] == ["causal", "docs", "window"]
    for mask in masks:
        fn, _leaves = vendor_kernels.flex_attention_call(mask, q, k, v)
        out = fn()
        dense = make_attn_mask(
            [list(r) for r in mask.q_ranges], [list(r) for r in mask.k_ranges], list(mask.types), total, total
        )
        ref, _ = ref_attn(*(x.double() for x in (q, k, v)), dense)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5, msg=mask.name)


def test_flex_attention_call_refuses_a_mask_it_cannot_express(monkeypatch) -> None:
    monkeypatch.setattr(vendor_kernels, "_FLEX", {"fn": None})
    mask = vendor_kernels.SliceMask.of([(0, 32), (32, 64)], [(0, 64), (0, 16)], [0, 2], 64, name="odd")
    q, k, v = random_qkv(64, 64, 1, 1, 16, torch.float32, "cpu", seed=1)
    with pytest.raises(vendor_kernels.VendorUnavailable, match="FlexAttention"):
        vendor_kernels.flex_attention_call(mask, q, k, v)
