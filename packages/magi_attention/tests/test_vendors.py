"""The vendor calls of ``info --bench`` and the benchmarks express the standard masks correctly.

On the CPU, PyTorch's FlexAttention runs eagerly (``torch.compile`` is swapped for the eager function), so
the block masks it builds from each standard mask are checked against dense float64 attention on the same
slices; the masks run one after the other in one process, as ``--bench`` calls them.
"""

from __future__ import annotations

import pytest
import torch

from magi_attention import vendors
from magi_ffa.testing import make_attn_mask, random_qkv, ref_attn


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_call_matches_dense_reference_on_every_standard_mask(monkeypatch) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    def eager(q, k, v, **kw):  # FlexAttention has no CPU backward: the forward on detached leaves
        return flex_attention(q.detach(), k.detach(), v.detach(), **kw)

    monkeypatch.setattr(vendors, "_FLEX", {"fn": eager})
    total = 256
    q, k, v = random_qkv(total, total, 2, 2, 16, torch.float32, "cpu", seed=3)
    masks = vendors.standard_masks(total, window=total // 4)
    assert [m.name for m in masks] == ["causal", "docs", "window"]
    for mask in masks:
        fn, _leaves = vendors.flex_attention_call(mask, q, k, v)
        out = fn()
        dense = make_attn_mask(
            [list(r) for r in mask.q_ranges], [list(r) for r in mask.k_ranges], list(mask.types), total, total
        )
        ref, _ = ref_attn(*(x.double() for x in (q, k, v)), dense)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5, msg=mask.name)


def test_flex_attention_call_refuses_a_mask_it_cannot_express(monkeypatch) -> None:
    monkeypatch.setattr(vendors, "_FLEX", {"fn": None})
    mask = vendors.SliceMask.of([(0, 32), (32, 64)], [(0, 64), (0, 16)], [0, 2], 64, name="odd")
    q, k, v = random_qkv(64, 64, 1, 1, 16, torch.float32, "cpu", seed=1)
    with pytest.raises(vendors.VendorUnavailable, match="FlexAttention"):
        vendors.flex_attention_call(mask, q, k, v)


def test_sdpa_call_refuses_what_it_cannot_express() -> None:
    q, k, v = random_qkv(64, 64, 2, 1, 16, torch.float32, "cpu", seed=1)
    docs = vendors.SliceMask.of([(0, 32), (32, 64)], [(0, 32), (32, 64)], [1, 1], 64, name="docs")
    with pytest.raises(vendors.VendorUnavailable, match="full or causal"):
        vendors.sdpa_call(docs, q, k, v)
    causal = vendors.SliceMask.of([(0, 64)], [(0, 64)], [1], 64, name="causal")
    with pytest.raises(ValueError, match="backend"):
        vendors.sdpa_call(causal, q, k, v, backend="math")


def test_importing_vendors_imports_no_vendor_and_no_compiler(tmp_path) -> None:
    """``import magi_attention.vendors`` adds no vendor module and no ``torch._dynamo`` / ``torch._inductor``
    to what ``import magi_attention`` loaded: stub ``flash_attn``, ``cudnn``, ``cutlass`` and ``quack``
    packages that raise when imported stand first on ``sys.path``."""
    import subprocess
    import sys

    for name in ("flash_attn", "cudnn", "cutlass", "quack"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise RuntimeError('{name} imported')\n")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import magi_attention; before = set(sys.modules); "
        "import magi_attention.vendors; new = sorted(set(sys.modules) - before); "
        "bad = [m for m in new if m.split('.')[0] in ('flash_attn', 'cudnn', 'cutlass', 'quack') "
        "or m.startswith(('torch._dynamo', 'torch._inductor'))]; print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
