"""Triton forward kernel of FFA and its launcher (no autograd).

One program per (q head, q block). It walks every slice that touches its q block (CSR from ``_meta``), for
each slice only the keys the slice's type leaves visible (``slice_walk``): boundary tiles with load and
element masks, the full tiles between them with neither; all slices feed one online softmax (exp2, log2e
folded into the scale), so overlapping q slices need no merge pass. Heads sharing a kv head are adjacent program ids (K/V tiles reused from L2). In accumulate mode
the epilogue merges with the caller's (out, lse). Deterministic: a fixed order, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._meta import axis_tiles
from ._slice import Slice
from ._tiles import fwd_tiles
from ._triton_common import (
    LN2,
    LOG2E,
    alloc,
    compute_flags,
    dot_,
    load_slice,
    merge_partials,
    slice_walk,
    tanh_,
    tile_visible,
)


@triton.jit
def fwd_tile(
    acc, m_i, l_i, q, K, V, k_desc, v_desc, hk, n0, end, offs_m, offs_d,
    stride_kt, stride_kh, stride_vt, stride_vh,
    qs, qe, ks, ke, dk, dk_inv, causal, inv, qk_scale, sm_scale, softcap,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr, MAX_ONLY: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys ``[n0, n0 + BLOCK_N)`` (base-2 scores). ``MASKED``: a boundary tile
    (loads masked to ``end``, element visibility applied); otherwise every pair is visible and nothing is
    masked, and with ``USE_TMA`` K and V come through tensor descriptors (``[total_k, heads_kv * d]`` views).
    ``MAX_ONLY``: the running row maxima alone (no V, no softmax)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_ptrs = K + offs_n[None, :] * stride_kt + hk * stride_kh + offs_d[:, None]
    v_ptrs = V + offs_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :]
    if MASKED:
        col_ok = offs_n < end
        kt = tl.load(k_ptrs, mask=col_ok[None, :], other=0.0)
    elif USE_TMA:
        kt = tl.trans(k_desc.load([n0, hk * offs_d.shape[0]]))
    else:
        kt = tl.load(k_ptrs)
    if UPCAST:
        kt = kt.to(tl.float32)
    s = dot_(q, kt, tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE)
    if SOFTCAP:
        s = tanh_(s * (sm_scale / softcap)) * (softcap * LOG2E)
    else:
        s = s * qk_scale
    if MASKED:
        vis = tile_visible(offs_m[:, None], offs_n[None, :], qs, qe, ks, ke, dk, dk_inv, causal, inv)
        s = tl.where(vis & col_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if not MAX_ONLY:
        if MASKED:
            vb = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see no key of this tile yet
        else:
            if USE_TMA:
                vb = v_desc.load([n0, hk * offs_d.shape[0]])
            else:
                vb = tl.load(v_ptrs)
            m_safe = m_new
        if UPCAST:
            vb = vb.to(tl.float32)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot_(p.to(vb.dtype), vb, acc * alpha[:, None], IEEE)
    return acc, m_new, l_i


# Mask- and token-count-dependent ints are not specialised (Triton would compile one variant per class
# ``== 1`` / ``% 16 == 0`` of each): a training loop hands every step new counts, and a compile per class
# costs seconds. The lse / max strides follow the caller's layout (a transposed view strides by total_q).
@triton.jit(
    do_not_specialize=[
        "total_q", "total_k", "stride_lt", "stride_lh", "stride_mt", "stride_mh",
    ]
)  # fmt: skip
def ffa_fwd_kernel(
    Q, K, V, O, LSE, SLICES, BLK_PTR, BLK_IDX, BLK_ORDER, SINK_LSE, MAXL,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh, stride_mt, stride_mh,
    total_q, total_k, num_heads_kv, sm_scale, softcap,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    HAS_SINK: tl.constexpr, RET_MAX: tl.constexpr, MAX_ONLY: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    pid_h = tl.program_id(0)
    k_desc = None
    v_desc = None
    if USE_TMA:
        k_desc = tl.make_tensor_descriptor(
            K,
            shape=[total_k, num_heads_kv * HEAD_DIM],
            strides=[stride_kt, 1],
            block_shape=[BLOCK_N, HEAD_DIM],
        )
        v_desc = tl.make_tensor_descriptor(
            V,
            shape=[total_k, num_heads_kv * HEAD_DIM],
            strides=[stride_vt, 1],
            block_shape=[BLOCK_N, HEAD_DIM],
        )
    blk = tl.load(BLK_ORDER + tl.program_id(1))
    hk = pid_h // GROUP
    m0 = blk * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < total_q
    q = tl.load(
        Q + offs_m[:, None] * stride_qt + pid_h * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    e0 = tl.load(BLK_PTR + blk)
    e1 = tl.load(BLK_PTR + blk + 1)
    for e in range(e0, e1):
        qs, qe, ks, ke, dk, dk_inv, causal, inv = load_slice(SLICES, tl.load(BLK_IDX + e))
        start, end, n_tiles, full_lo, full_hi = slice_walk(
            m0, qs, qe, ks, ke, inv, dk_inv, causal, dk, BLOCK_M, BLOCK_N
        )
        # the boundary tiles of both ends in one loop, then the full run without masks: two software-pipelined
        # loops per slice, not three (fewer prologues on short walks; the backward's spills fell 3x this way)
        n_full = full_hi - full_lo
        for j in range(0, n_tiles - n_full):
            i = tl.where(j < full_lo, j, j + n_full)
            acc, m_i, l_i = fwd_tile(
                acc, m_i, l_i, q, K, V, k_desc, v_desc, hk, start + i * BLOCK_N, end, offs_m, offs_d,
                stride_kt, stride_kh, stride_vt, stride_vh, qs, qe, ks, ke, dk, dk_inv, causal, inv,
                qk_scale, sm_scale, softcap, BLOCK_N, True, SOFTCAP, UPCAST, IEEE, MAX_ONLY, USE_TMA,
            )  # fmt: skip
        for i in range(full_lo, full_hi):
            acc, m_i, l_i = fwd_tile(
                acc, m_i, l_i, q, K, V, k_desc, v_desc, hk, start + i * BLOCK_N, end, offs_m, offs_d,
                stride_kt, stride_kh, stride_vt, stride_vh, qs, qe, ks, ke, dk, dk_inv, causal, inv,
                qk_scale, sm_scale, softcap, BLOCK_N, False, SOFTCAP, UPCAST, IEEE, MAX_ONLY, USE_TMA,
            )  # fmt: skip
    if RET_MAX:
        # the row's largest visible scaled (soft-capped) score, natural units; -inf for rows without keys
        tl.store(MAXL + offs_m * stride_mt + pid_h * stride_mh, m_i * LN2, mask=row_ok)
    if not MAX_ONLY:
        pos = l_i > 0
        l_safe = tl.where(pos, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(pos, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
        if HAS_SINK:
            # the sinks: one more partial result, out 0 and lse logsumexp_t sink[t, h], merged once per row
            # here, before any accumulate-mode merge (the merge is associative)
            ls = tl.load(SINK_LSE + pid_h)
            mx = tl.maximum(lse, ls)
            mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
            w_a = tl.exp(lse - mx_safe)
            tot = w_a + tl.exp(ls - mx_safe)
            has = tot > 0.0
            tot_safe = tl.where(has, tot, 1.0)
            c_a = tl.where(has, w_a / tot_safe, 0.0)
            o = tl.where(c_a[:, None] > 0.0, o * c_a[:, None], 0.0)
            lse = tl.where(has, mx_safe + tl.log(tot_safe), float("-inf"))
        o_ptrs = O + offs_m[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :]
        l_ptrs = LSE + offs_m * stride_lt + pid_h * stride_lh
        if ACCUM:
            # merge with the caller's partial result; rows at -inf ignore the old out entirely
            lse_prev = tl.load(l_ptrs, mask=row_ok, other=float("-inf"))
            o_prev = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
            o, lse = merge_partials(o_prev, lse_prev, o, lse)
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(l_ptrs, lse, mask=row_ok)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tma_ok(t: torch.Tensor) -> bool:
    """A ``[tokens, heads, d]`` tensor viewable as a TMA-legal 2-D ``[tokens, heads * d]`` (heads packed, 16-byte
    aligned base and row stride)."""
    size = t.element_size()
    return t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0


def _tma_allocator(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need Triton's scratch allocator; set one in this context if none is (a
    caller's own allocator is kept). Triton keeps it in a private context variable (3.6); if that moves, set
    ours."""
    try:
        from triton.runtime import _allocation

        unset = _allocation._allocator.get() is _allocation._NULL_ALLOCATOR
    except (ImportError, AttributeError):
        unset = True
    if unset:
        triton.set_allocator(_tma_allocator)


def triton_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slices: tuple[Slice, ...],
    scale: float,
    softcap: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    sink_lse: torch.Tensor | None = None,
    row_max: torch.Tensor | None = None,
    max_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs (q ``[total_q, num_heads_q, head_dim]``, k/v ``[total_k,
    num_heads_kv, head_dim]``). ``out``/``lse`` given: merged into in place; else allocated (out in q's dtype,
    lse float32 ``[total_q, num_heads_q]``). ``sink_lse`` (float32 ``[num_heads_q]``): merged into this
    call's result in the epilogue. ``row_max`` (float32 ``[total_q, num_heads_q]``): receives each row's
    largest visible scaled score (-inf without keys); with ``max_only`` nothing else is computed or written
    (out and lse are then returned untouched)."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    tq, hq, d = q.shape
    upcast, ieee = compute_flags(q)
    t = fwd_tiles(q)
    accum = out is not None
    if max_only:
        if row_max is None:
            raise ValueError("max_only needs row_max")
        out = lse = None
    elif not accum:
        out = alloc(q.shape, q.dtype, q.device)
        lse = alloc((tq, hq), torch.float32, q.device)
    if tq == 0:
        return out, lse
    if out is not None and out.stride(-1) != 1:
        raise ValueError("`out` must be contiguous in its last dimension for the triton backend")
    meta = axis_tiles(slices, tq, t.block_m, "q", str(q.device))
    use_tma = t.tma and k.shape[0] > 0 and _tma_ok(k) and _tma_ok(v)
    if use_tma and q.is_cuda:
        _ensure_tma_allocator()
    # unused pointers get a valid tensor (never read: their constexpr flag is off)
    o_arg, l_arg = (row_max, row_max) if out is None else (out, lse)
    m_arg = l_arg if row_max is None else row_max
    ffa_fwd_kernel[(hq, meta.num_blocks)](
        Q=q, K=k, V=v, O=o_arg, LSE=l_arg, SLICES=meta.slices, BLK_PTR=meta.ptr, BLK_IDX=meta.idx,
        BLK_ORDER=meta.order, SINK_LSE=l_arg if sink_lse is None else sink_lse, MAXL=m_arg,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_ot=o_arg.stride(0), stride_oh=o_arg.stride(1),
        stride_lt=l_arg.stride(0), stride_lh=l_arg.stride(1),
        stride_mt=m_arg.stride(0), stride_mh=m_arg.stride(1),
        total_q=tq, total_k=k.shape[0], num_heads_kv=k.shape[1], sm_scale=scale, softcap=softcap if softcap > 0 else 1.0,
        GROUP=hq // k.shape[1], HEAD_DIM=d, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        SOFTCAP=softcap > 0, ACCUM=accum and not max_only, UPCAST=upcast, IEEE=ieee,
        HAS_SINK=sink_lse is not None and not max_only, RET_MAX=row_max is not None, MAX_ONLY=max_only,
        USE_TMA=use_tma,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out, lse
