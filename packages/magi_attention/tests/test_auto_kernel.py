"""`kernel_backend="auto"`: the table's pick among the backends every rank can run, the same on every rank,
refined per call by dtype and softcap, overridden by an explicit backend; visible through get_kernel_backend."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

import magi_attention._runtime.key_route as runtime_mod
import magi_solver.kernel_choice as kernel_choice
from magi_attention import DistAttnConfig, clear_cache, get_kernel_backend, magi_attn_flex_key
from magi_attention._layout import build_layout
from magi_attention._runtime.cache import RUNTIME_CACHE
from magi_attention._runtime.kernels import RankBackends, attn_kernel, choose_auto, resolve
from magi_attention._runtime.key_route import rank_problems
from magi_attention.config import KernelBackend as B
from magi_attention.key import CpGroup
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_solver import long_tailed_cu_seqlens
from magi_solver.kernel_choice import KernelTable, busiest_rank_features, load_kernel_table, pick_kernel

FA4_CUDNN = RankBackends("h200", ("cudnn", "fa4", "torch", "triton"))
FA4_ONLY = RankBackends("h200", ("fa4", "torch", "triton"))


def _docs(total: int) -> list[list[int]]:
    cuts = [0, 900, 2500, 3100, 6000, total]
    return [[a, b] for a, b in itertools.pairwise(cuts)]


def _features(q, k, t, total):
    return lambda: busiest_rank_features(q, k, t, [np.arange(total)])


def _auto(ranks, q, k, t, total, head_dim=128):
    return choose_auto(resolve(B.AUTO, head_dim, ranks), head_dim, _features(q, k, t, total))


def test_table_picks_per_mask_among_what_every_rank_runs() -> None:
    total = 8192
    docs = _docs(total)
    varlen = _auto([FA4_CUDNN, FA4_CUDNN], docs, docs, [1] * len(docs), total)
    pick = pick_kernel(load_kernel_table("h200"), _features(docs, docs, [1] * len(docs), total)(), 128,
                       ["fa4", "cudnn", "triton"])  # fmt: skip
    assert varlen.backend == B(pick.forward) and varlen.backward_for(torch.bfloat16, 128) == B(pick.backward)
    assert "nearest measured row" in varlen.reason and "documents" in varlen.reason
    # a fragmented mask: overlapping slices of several types
    q = [[0, 4096], [0, 4096], [2048, 8192], [4096, 8192]]
    k = [[0, 1024], [2048, 3072], [0, 8192], [5000, 6000]]
    frag = _auto([FA4_CUDNN, FA4_CUDNN], q, k, [0, 3, 1, 0], total)
    assert frag.backend == B.CUDNN and frag.requested == B.AUTO
    # one rank without cuDNN: no rank picks it (the gathered flags are the same on every rank)
    assert _auto([FA4_CUDNN, FA4_ONLY], q, k, [0, 3, 1, 0], total).backend == B.FA4
    assert _auto([FA4_ONLY, FA4_CUDNN], q, k, [0, 3, 1, 0], total).backend == B.FA4


def test_without_a_table_or_a_row_the_capability_rule_stays_and_says_so() -> None:
    other = RankBackends("b200", FA4_CUDNN.usable)
    c = _auto([other], [[0, 10]], [[0, 10]], [0], 10)
    assert c.backend == B.FA4 and "no measured kernel table for GPU kind 'b200'" in c.reason
    # head_dim 256: FA4 cannot, cuDNN and Triton can (the h200 table measured both); none of 64
    c = _auto([FA4_CUDNN], [[0, 10]], [[0, 10]], [0], 10, head_dim=256)
    assert c.backend == B.CUDNN and "d 256" in c.reason
    c = _auto([FA4_CUDNN], [[0, 10]], [[0, 10]], [0], 10, head_dim=64)
    assert c.backend == B.FA4 and "no row for head_dim 64" in c.reason


def test_explicit_backends_are_never_changed() -> None:
    for requested in (B.FA4, B.CUDNN, B.TRITON, B.TORCH):
        c = choose_auto(resolve(requested, 128, [FA4_CUDNN]), 128, lambda: pytest.fail("features computed"))
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
        resolve(B.CUDNN, 128, [FA4_CUDNN]).backend_for(torch.bfloat16, 128, softcap=30.0)


def test_rank_problems_features_and_the_accessor_on_a_key(monkeypatch) -> None:
    monkeypatch.delenv("MAGI_ATTENTION_KERNEL_BACKEND", raising=False)
    docs = _docs(8192)
    key = magi_attn_flex_key(docs, docs, "causal", 8192, 8192, 4, 2, 64, None, DistAttnConfig())
    f = rank_problems(key, build_layout(key)).features()
    assert f == rank_problems(key, build_layout(key)).features()  # a pure function of the key
    assert f.tokens == 8192 and f.documents
    backend, reason = get_kernel_backend(key)
    assert backend == B.TORCH and reason.startswith("auto:")  # this CPU runs the torch path
    monkeypatch.setenv("MAGI_ATTENTION_KERNEL_BACKEND", "torch")
    clear_cache()  # the override is read when a key is planned
    key2 = magi_attn_flex_key(docs, docs, "causal", 8192, 8192, 4, 2, 64, None, DistAttnConfig())
    assert get_kernel_backend(key2) == (B.TORCH, "kernel_backend='torch' (explicit)")


def _packed_documents(total: int) -> list[list[int]]:
    """The documents of the varlen masks the shipped table and the cp benchmarks measured."""
    return [list(doc) for doc in itertools.pairwise(long_tailed_cu_seqlens(total))]


def _simulated_key(q, k, types, total_q, total_k, cp: int, chunk_size: int | None = None):
    """A key of a cp group of `cp` ranks that exists on paper only: dispatch and features need no group."""
    key = magi_attn_flex_key(
        q, k, types, total_q, total_k, 64, 8, 128, None, DistAttnConfig(), chunk_size=chunk_size
    )
    return dataclasses.replace(key, cp_group=CpGroup("simulated", tuple(range(cp))))


def test_features_are_of_the_busiest_ranks_problem_as_its_kernel_sees_it() -> None:
    """Packed causal documents at cp 8, 8192 tokens per rank: documents cut by rank boundaries reach keys
    other ranks send, so in the kernel's key coordinates (own keys, then received keys) the busiest rank's
    problem is not packed documents any more; the h200 table's nearest row is then one that is not
    documents either, and auto takes that row's fastest backend (cuDNN)."""
    total, cp = 8 * 8192, 8
    docs = _packed_documents(total)
    key = _simulated_key(docs, docs, "causal", total, total, cp, chunk_size=2048)
    layout = build_layout(key)
    f = rank_problems(key, layout).features()
    rows = [layout.local_token_ids(r) for r in range(cp)]
    assert f == busiest_rank_features(docs, docs, [1] * len(docs), rows, rank_keys=rows)
    assert f.tokens == 8192 and not f.documents and f.slices_per_row > 1.2
    # the same rows against global key ids are packed documents: what auto keyed its table by before
    assert busiest_rank_features(docs, docs, [1] * len(docs), rows).documents
    table = load_kernel_table("h200")
    choice = choose_auto(resolve(B.AUTO, 128, [FA4_CUDNN] * cp), 128, lambda: f)
    row = next(r for r in table.rows if f"nearest measured row {r['mask']} at {r['tokens']} tokens" in choice.reason
               and r["head_dim"] == 128)  # fmt: skip
    assert not row["documents"]
    fastest = min(("fa4", "cudnn"), key=lambda b: sum(row["ms"][b]))
    assert choice.backend == B(fastest) == B.CUDNN and choice.backward_for(torch.bfloat16, 128) == B.CUDNN
    # every rank builds the same layout and features (no communication)
    assert rank_problems(key, build_layout(key)).features() == f


def test_features_at_cp_1_are_the_global_masks() -> None:
    """One rank holds every key in global order: the kernel runs the global mask, as the table measured."""
    docs = _docs(8192)
    key = magi_attn_flex_key(docs, docs, "causal", 8192, 8192, 4, 2, 64, None, DistAttnConfig())
    f = rank_problems(key, build_layout(key)).features()
    assert f == busiest_rank_features(docs, docs, [1] * len(docs), [np.arange(8192)])
    assert f.documents and f.slices_per_row == 1.0


def test_cross_attention_features_use_the_key_value_shards() -> None:
    """Cross-attention at cp 2: keys live in contiguous halves of the key/value sequence, whatever the queries'
    dispatch. Two documents, queries [0, 256) on keys [0, 128) and [256, 512) on [128, 256): every rank has
    the same area, so rank 0 is the busiest; it holds the first key document, so in its kernel's coordinates
    (own keys, then received keys) the documents stay packed. Holding the second half instead, its first
    query document would read keys placed after the second's: not packed."""
    q, k = [[0, 256], [256, 512]], [[0, 128], [128, 256]]
    key = _simulated_key(q, k, "full", 512, 256, 2)
    layout = build_layout(key)
    assert [layout.kv_layout.host_pairs(r) for r in range(2)] == [[(0, 128)], [(128, 256)]]
    f = rank_problems(key, layout).features()
    assert (f.tokens, f.area, f.slices_per_row, f.documents) == (256, 256 * 128, 1.0, True)
    rows = [layout.local_token_ids(r) for r in range(2)]
    swapped = [np.arange(128, 256), np.arange(0, 128)]
    assert not busiest_rank_features(q, k, [0, 0], rows, rank_keys=swapped).documents


SPLIT_TABLE = KernelTable.from_dict({"gpu_kind": "h200", "rows": [
    {"mask": "docs", "tokens": 8192, "head_dim": 128, "tile_fill": 0.7, "slices_per_row": 1.0, "documents": True,
     "ms": {"fa4": [1.0, 3.0], "cudnn": [1.6, 2.5], "triton": [3.0, 9.0]}},
    {"mask": "docs", "tokens": 8192, "head_dim": 32, "tile_fill": 0.7, "slices_per_row": 1.0, "documents": True,
     "ms": {"triton": [1.0, 9.0], "torch": [5.0, 2.0]}},
]})  # fmt: skip


def test_split_directions_refined_per_call(monkeypatch) -> None:
    """A table whose forward and backward winners differ by more than SPLIT_GAIN: the forward on one
    backend, the backward on the other, each refined by dtype and softcap like a single choice."""
    monkeypatch.setattr(kernel_choice, "load_kernel_table", lambda kind: SPLIT_TABLE)
    docs = _docs(8192)
    c = _auto([FA4_CUDNN, FA4_CUDNN], docs, docs, [1] * len(docs), 8192)
    assert (c.backend, c.backward) == (B.FA4, B.CUDNN) and "fa4 forward, cudnn backward" in c.reason
    assert (c.backend_for(torch.bfloat16, 128), c.backward_for(torch.bfloat16, 128)) == (B.FA4, B.CUDNN)
    # cuDNN takes no softcap: that call's backward stays on FA4; fp32 / fp64 leave both directions
    assert c.backward_for(torch.bfloat16, 128, softcap=30.0) == B.FA4
    assert (c.backend_for(torch.float32, 128), c.backward_for(torch.float32, 128)) == (B.TRITON, B.TRITON)
    assert c.backward_for(torch.float64, 128) == B.TORCH
    # a rank without cuDNN: no split, on every rank alike
    c = _auto([FA4_CUDNN, FA4_ONLY], docs, docs, [1] * len(docs), 8192)
    assert (c.backend, c.backward) == (B.FA4, None)
    k = attn_kernel(B.FA4, B.CUDNN)
    assert (k.backend, k.backward_backend) == (B.FA4, B.CUDNN) and attn_kernel(
        B.FA4
    ).backward_backend == B.FA4


def test_split_kernels_through_calc_attn(monkeypatch) -> None:
    """The runtime with a forward on one backend and a backward on another (Triton forward, torch backward
    here, the two this CPU runs) gives the reference's output and gradients, at cp 1 through one launcher
    call each way."""
    monkeypatch.delenv("MAGI_ATTENTION_KERNEL_BACKEND", raising=False)
    real = runtime_mod.choose_auto

    def split(choice, head_dim, features, **kw):
        import dataclasses

        return dataclasses.replace(real(choice, head_dim, features, **kw), backend=B.TRITON, backward=B.TORCH,
                                   reason="test: triton forward, torch backward")  # fmt: skip

    monkeypatch.setattr(runtime_mod, "choose_auto", split)
    clear_cache()
    total, hq, hk, d = 40, 2, 1, 16
    qr, kr, tm = [[0, 24], [8, 40], [20, 40]], [[0, 24], [0, 30], [4, 36]], [1, 3, 2]
    key = magi_attn_flex_key(qr, kr, tm, total, total, hq, hk, d, None, DistAttnConfig())
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(total, h, d, generator=gen) for h in (hq, hk, hk, hq))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kern = RUNTIME_CACHE.get(key).kernel(torch.float32)
    assert (kern.backend, kern.backward_backend) == (B.TRITON, B.TORCH)
    out, meta = __import__("magi_attention").calc_attn(*leaves, key)
    assert out.grad_fn.name().endswith("_SingleCallBackward")  # one launcher call each way
    # gradients through out and lse (the lse weights: rows with no key are -inf and take none)
    w = torch.randn(total, hq, generator=gen)
    mask = make_attn_mask(qr, kr, tm, total, total)
    w[~mask.any(1)] = 0
    lse_term = torch.where(torch.isinf(meta.lse), 0.0, meta.lse) * w
    grads = torch.autograd.grad((out * do).sum() + lse_term.sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = ref_attn(*ref_leaves, mask)
    ref_term = torch.where(torch.isinf(ref_lse), 0.0, ref_lse) * w.double()
    ref_grads = torch.autograd.grad((ref * do.double()).sum() + ref_term.sum(), ref_leaves)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=2e-4)
    clear_cache()
