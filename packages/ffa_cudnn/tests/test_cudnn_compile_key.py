"""Compiled-kernel keys of the cuDNN backend do not follow a mask's values or counts.

cuDNN's flex_attention takes the mask function's endpoint count (``nfunc``) and the plan's block counts as
runtime values of its kernels; ``magi_ffa_cudnn._launch.compile_key`` mirrors its keys. Twenty new masks
(random overlapping slices of all four types, packed documents, sliding windows, token counts that differ)
give mask functions of many widths and one key; the configuration (dtype, head dim, GQA ratio, determinism,
dlse, max logits, architecture) is what changes it.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from magi_ffa_cudnn import mask_func_from_intervals, visible_from_mask_func
from magi_ffa_cudnn._launch import compile_key

from magi_ffa.intervals import row_intervals
from magi_ffa.testing import make_attn_mask, random_overlapping_slices

CONFIG = dict(dtype=torch.bfloat16, head_dim=128, num_heads_q=8, num_heads_kv=2)


def _masks(n: int, seed: int = 0):
    rng = random.Random(seed)
    for i in range(n):
        total = rng.randint(200, 400)
        kind = ("random", "docs", "window", "stripes")[i % 4]
        if kind == "random":
            qr, kr, tm = random_overlapping_slices(rng, total, total, rng.randint(2, 30))
        elif kind == "docs":
            cuts = sorted({0, total, *(rng.randrange(1, total) for _ in range(rng.randint(1, 8)))})
            qr = kr = [list(d) for d in itertools.pairwise(cuts)]
            tm = [rng.choice([0, 1])] * len(qr)
        elif kind == "window":
            w = rng.randint(8, total // 2)
            qr, kr, tm = [[0, w], [w, total]], [[0, w], [1, total]], [1, 3]
        else:
            m = rng.randint(3, 9)
            qr = [[0, total]] * m
            kr = [[s * total // m, s * total // m + rng.randint(4, 16)] for s in range(m)]
            tm = [0] * m
        yield qr, kr, tm, total


def test_twenty_new_masks_share_one_key() -> None:
    keys, widths = set(), set()
    for qr, kr, tm, total in _masks(20):
        iv = row_intervals(*(torch.tensor(x, dtype=torch.int32) for x in (qr, kr, tm)), total, total)
        func = mask_func_from_intervals(iv)
        # the mask function is the mask (what cuDNN reads at run time)
        assert torch.equal(visible_from_mask_func(func, total), make_attn_mask(qr, kr, tm, total, total))
        widths.add(func.shape[1])
        keys.add(compile_key(nfunc=func.shape[1], **CONFIG))
    assert len(widths) >= 4, "the stream must give mask functions of several widths"
    assert len(keys) == 1
    (key,) = keys
    fwd, bwd = key
    assert fwd[0] == "fwd" and bwd[0] == "bwd"


def test_the_configuration_is_the_key() -> None:
    base = compile_key(nfunc=3, **CONFIG)
    for change in (
        dict(dtype=torch.float16),
        dict(head_dim=64),
        dict(num_heads_kv=8),
        dict(deterministic=True),
        dict(want_max=True),
        dict(has_dlse=True),
        dict(arch=100),
    ):
        assert compile_key(nfunc=3, **{**CONFIG, **change}) != base, change
    # sm100's plan hint is a key there, ignored on sm90
    assert compile_key(nfunc=3, **CONFIG, narrow_workset=True) == base
    assert compile_key(nfunc=3, **CONFIG, arch=100, narrow_workset=True) != compile_key(
        nfunc=3, **CONFIG, arch=100
    )


@pytest.mark.parametrize("nfunc", [0, 2, -1, 3.0, True])
def test_bad_nfunc_raises(nfunc) -> None:
    with pytest.raises(ValueError, match="nfunc"):
        compile_key(nfunc=nfunc, **CONFIG)
