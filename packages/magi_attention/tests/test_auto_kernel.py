"""`kernel_backend="auto"`: the table's pick among the backends every rank can run, the same on every rank,
refined per call by dtype and softcap, overridden by an explicit backend; visible through get_kernel_backend."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from magi_attention import DistAttnConfig, clear_cache, get_kernel_backend, magi_attn_flex_key
from magi_attention._kernels import LocalCapability, _resolve, choose_auto
from magi_attention._layout import build_layout
from magi_attention._runtime import rank_problem_features
from magi_attention.config import KernelBackend as B
from magi_solver.kernel_choice import busiest_rank_features

FA4_CUDNN = LocalCapability("", "", "h200", "")
FA4_ONLY = LocalCapability("", "", "h200", "cuDNN's flex_attention does not import")


def _docs(total: int) -> list[list[int]]:
    cuts = [0, 900, 2500, 3100, 6000, total]
    return [[a, b] for a, b in itertools.pairwise(cuts)]


def _features(q, k, t, total):
    return lambda: busiest_rank_features(q, k, t, [np.arange(total)])


def _auto(ranks, q, k, t, total, head_dim=128):
    return choose_auto(_resolve(B.AUTO, head_dim, ranks), head_dim, _features(q, k, t, total))


def test_table_picks_per_mask_among_what_every_rank_runs() -> None:
    total = 8192
    docs = _docs(total)
    varlen = _auto([FA4_CUDNN, FA4_CUDNN], docs, docs, [1] * len(docs), total)
    assert varlen.backend == B.FA4 and "nearest measured row varlen_" in varlen.reason
    # a fragmented mask: overlapping slices of several types
    q = [[0, 4096], [0, 4096], [2048, 8192], [4096, 8192]]
    k = [[0, 1024], [2048, 3072], [0, 8192], [5000, 6000]]
    frag = _auto([FA4_CUDNN, FA4_CUDNN], q, k, [0, 3, 1, 0], total)
    assert frag.backend == B.CUDNN and frag.requested == B.AUTO
    # one rank without cuDNN: no rank picks it (the gathered flags are the same on every rank)
    assert _auto([FA4_CUDNN, FA4_ONLY], q, k, [0, 3, 1, 0], total).backend == B.FA4
    assert _auto([FA4_ONLY, FA4_CUDNN], q, k, [0, 3, 1, 0], total).backend == B.FA4


def test_without_a_table_or_a_row_the_capability_rule_stays_and_says_so() -> None:
    other = LocalCapability("", "", "b200", "")
    c = _auto([other], [[0, 10]], [[0, 10]], [0], 10)
    assert c.backend == B.FA4 and "no measured kernel table for GPU kind 'b200'" in c.reason
    # head_dim 256: FA4 cannot, cuDNN and Triton can; the h200 table measured d 128 only
    c = _auto([FA4_CUDNN], [[0, 10]], [[0, 10]], [0], 10, head_dim=256)
    assert c.backend == B.TRITON and "no row for head_dim 256" in c.reason


def test_explicit_backends_are_never_changed() -> None:
    for requested in (B.FA4, B.CUDNN, B.TRITON, B.TORCH):
        c = choose_auto(_resolve(requested, 128, [FA4_CUDNN]), 128, lambda: pytest.fail("features computed"))
        assert c.backend == requested and c.reason == f"kernel_backend={requested.value!r} (explicit)"


def test_refinement_by_dtype_and_softcap() -> None:
    q = [[0, 4096], [0, 4096], [2048, 8192], [4096, 8192]]
    k = [[0, 1024], [2048, 3072], [0, 8192], [5000, 6000]]
    c = _auto([FA4_CUDNN], q, k, [0, 3, 1, 0], 8192)
    assert c.backend == B.CUDNN
    assert c.backend_for(torch.bfloat16, 128) == B.CUDNN
    assert c.backend_for(torch.bfloat16, 128, softcap=30.0) == B.FA4  # cuDNN has no softcap
    assert c.backend_for(torch.float32, 128) == B.TRITON
    assert c.backend_for(torch.float64, 128) == B.TORCH
    with pytest.raises(ValueError, match="softcap"):
        _resolve(B.CUDNN, 128, [FA4_CUDNN]).backend_for(torch.bfloat16, 128, softcap=30.0)


def test_rank_problem_features_and_the_accessor_on_a_key(monkeypatch) -> None:
    monkeypatch.delenv("MAGI_ATTENTION_KERNEL_BACKEND", raising=False)
    docs = _docs(8192)
    key = magi_attn_flex_key(docs, docs, "causal", 8192, 8192, 4, 2, 64, None, DistAttnConfig())
    f = rank_problem_features(key, build_layout(key))
    assert f == rank_problem_features(key, build_layout(key))  # a pure function of the key
    assert f.tokens == 8192 and f.documents
    backend, reason = get_kernel_backend(key)
    assert backend == B.TORCH and reason.startswith("auto:")  # this CPU runs the torch path
    monkeypatch.setenv("MAGI_ATTENTION_KERNEL_BACKEND", "torch")
    clear_cache()  # the override is read when a key is planned
    key2 = magi_attn_flex_key(docs, docs, "causal", 8192, 8192, 4, 2, 64, None, DistAttnConfig())
    assert get_kernel_backend(key2) == (B.TORCH, "kernel_backend='torch' (explicit)")
