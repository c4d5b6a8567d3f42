"""FlexAttention mask_mod -> slices: exact (dense equality), compact on structured masks, strict on bad input."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_attention import mask_mod as mm
from magi_attention.api import calc_attn, infer_attn_mask_from_mask_mod, magi_attn_flex_key
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_solver import AttnMaskType


def _dense(mask_mod, tq: int, tk: int) -> torch.Tensor:
    q, k = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    return torch.broadcast_to(mask_mod(torch.tensor(0), torch.tensor(0), q, k), (tq, tk))


def _union(q_ranges, k_ranges, types, tq: int, tk: int) -> torch.Tensor:
    qr = [[r.start, r.end] for r in q_ranges]
    kr = [[r.start, r.end] for r in k_ranges]
    return make_attn_mask(qr, kr, [t.code for t in types], tq, tk)


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _family(name: str, doc: torch.Tensor, param: int, table: torch.Tensor | None):
    starts = torch.zeros_like(doc)
    for d in range(int(doc.max()) + 1):
        starts[doc == d] = int((doc == d).nonzero()[0, 0])

    def same_doc(q, k):
        return doc[q] == doc[k]

    return {
        "doc_causal": lambda b, h, q, k: same_doc(q, k) & (q >= k),
        "doc_full": lambda b, h, q, k: same_doc(q, k),
        "window": lambda b, h, q, k: same_doc(q, k) & (q >= k) & (q - k <= param),
        "bidir_window": lambda b, h, q, k: same_doc(q, k) & ((q - k).abs() <= param),
        "prefix_lm": lambda b, h, q, k: same_doc(q, k) & ((q >= k) | (k - starts[k] < param)),
        "random_table": lambda b, h, q, k: table[q, k],
    }[name]


FAMILIES = ["doc_causal", "doc_full", "window", "bidir_window", "prefix_lm", "random_table"]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(FAMILIES),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    param=st.integers(0, 12),
    seed=st.integers(0, 2**16),
    tile_rows=st.sampled_from([1, 7, 1000]),
)
def test_union_equals_the_mask(name, lengths, param, seed, tile_rows) -> None:
    total = sum(lengths)
    doc = _doc_ids(lengths)
    table = torch.rand(total, total, generator=torch.Generator().manual_seed(seed)) < 0.4
    fn = _family(name, doc, param, table)
    old = mm._TILE_ELEMENTS
    mm._TILE_ELEMENTS = tile_rows * total  # tiles of `tile_rows` rows: results must not depend on tiling
    try:
        q, k, t = infer_attn_mask_from_mask_mod(fn, total, total)
    finally:
        mm._TILE_ELEMENTS = old
    assert torch.equal(_union(q, k, t, total, total), _dense(fn, total, total))


def test_cross_shapes_and_empty_rows() -> None:
    def fn(b, h, q, k):
        return (k >= 2 * q) & (k < 2 * q + 5) & (q % 3 != 1)

    q, k, t = infer_attn_mask_from_mask_mod(fn, 20, 50)
    assert torch.equal(_union(q, k, t, 20, 50), _dense(fn, 20, 50))


@pytest.mark.parametrize(
    ("name", "param", "per_doc"),
    [
        ("doc_causal", 0, [AttnMaskType.CAUSAL]),
        ("doc_full", 0, [AttnMaskType.FULL]),
        ("window", 8, [AttnMaskType.CAUSAL, AttnMaskType.BI_CAUSAL]),
        ("prefix_lm", 5, [AttnMaskType.FULL, AttnMaskType.CAUSAL]),
    ],
)
def test_structured_masks_are_compact(name: str, param: int, per_doc: list[AttnMaskType]) -> None:
    lengths = [30, 57, 41, 64]
    fn = _family(name, _doc_ids(lengths), param, None)
    q, k, t = infer_attn_mask_from_mask_mod(fn, sum(lengths), sum(lengths))
    assert list(t) == per_doc * len(lengths)
    assert torch.equal(_union(q, k, t, sum(lengths), sum(lengths)), _dense(fn, sum(lengths), sum(lengths)))


def test_head_or_batch_dependent_masks_are_rejected() -> None:
    with pytest.raises(ValueError, match="batch or head"):
        infer_attn_mask_from_mask_mod(lambda b, h, q, k: (q >= k) & (h == 0), 16, 16)
    with pytest.raises(ValueError, match="batch or head"):
        infer_attn_mask_from_mask_mod(lambda b, h, q, k: (q >= k) ^ (b != h), 16, 16)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("not callable", 4, 4), TypeError, "callable"),
        ((lambda b, h, q, k: q - k, 4, 4), TypeError, "bool"),
        ((lambda b, h, q, k: torch.ones(3, dtype=torch.bool), 4, 4), ValueError, "broadcast"),
        ((lambda b, h, q, k: q >= k, 0, 4), ValueError, "total_seqlen_q"),
        ((lambda b, h, q, k: q >= k, 4, 2.5), ValueError, "total_seqlen_k"),
    ],
)
def test_bad_input(args, error, match) -> None:
    with pytest.raises(error, match=match):
        infer_attn_mask_from_mask_mod(*args)


def test_inferred_slices_drive_calc_attn() -> None:
    """The result goes straight into a key; attention equals dense fp64 attention on the mask_mod."""
    lengths = [11, 25, 8]
    total = sum(lengths)
    fn = _family("window", _doc_ids(lengths), 6, None)
    q_ranges, k_ranges, types = infer_attn_mask_from_mask_mod(fn, total, total)
    key = magi_attn_flex_key(q_ranges, k_ranges, types, total, total, 2, 1, 8, None)
    gen = torch.Generator().manual_seed(random.Random(1).randrange(100))
    q, k, v = (torch.randn(total, h, 8, dtype=torch.float64, generator=gen) for h in (2, 1, 1))
    out, _ = calc_attn(q, k, v, key)
    ref, _ = ref_attn(q, k, v, _dense(fn, total, total))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
