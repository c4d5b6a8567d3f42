"""Triton backward kernel of FFA (one launch) and its launcher (no autograd).

One launch, two kinds of programs (as FlexAttention's backward template does):

- K/V programs, one per (kv head, k block of ``BLOCK_N1`` keys): hold k and v, walk every slice that touches
  the block, every q head of the GQA group and the visible q rows ``BLOCK_M1`` at a time, accumulating dk
  and dv in registers;
- q programs, one per (q head, q block of ``BLOCK_M2`` rows): hold q and do, walk the forward's way over the
  visible keys ``BLOCK_N2`` at a time, accumulating dq in registers.

Each output block has exactly one owner, so overlapping slices need no atomics and the result is bitwise
deterministic, always. Both walks are ``slice_walk``: boundary tiles with load and element masks, the full
tiles between them with neither. Gradients use the final lse (``P = exp2(S * log2e - lse * log2e)``) and
``delta = rowsum(do * out) - dlse``, both computed once before the launch and laid out ``[heads, rows]`` so
that a tile's rows are one contiguous read; rows with lse -inf get ``+inf`` in base 2, hence P = 0.
Accumulators are fp32 (added to when given).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._meta import axis_tiles
from ._slice import Slice
from ._tiles import bwd_tiles
from ._triton_common import LOG2E, alloc, compute_flags, dot_, load_slice, slice_walk, tanh_, tile_visible


@triton.jit
def dkv_tile(
    Q, DO, LSE2, DELTA, kb, vb, dk_acc, dv_acc, h, m0, end, offs_n, offs_d,
    qs, qe, ks, ke, dk, dk_inv, causal, inv,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, sm_scale, softcap,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """One (k block, q head ``h``, q rows ``[m0, m0 + BLOCK_M)``) step: adds to dk_acc / dv_acc ``[BLOCK_N,
    d]`` (dk unscaled). ``MASKED``: a boundary tile (rows masked to ``end``, element visibility applied)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    qt_ptrs = Q + offs_m[None, :] * stride_qt + h * stride_qh + offs_d[:, None]
    do_ptrs = DO + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :]
    if MASKED:
        row_ok = offs_m < end
        qt = tl.load(qt_ptrs, mask=row_ok[None, :], other=0.0)
        lse2 = tl.load(LSE2 + h * stride_lh + offs_m, mask=row_ok, other=float("inf"))
    else:
        qt = tl.load(qt_ptrs)
        lse2 = tl.load(LSE2 + h * stride_lh + offs_m)
    if UPCAST:
        qt = qt.to(tl.float32)
    st = dot_(kb, qt, tl.zeros([kb.shape[0], BLOCK_M], tl.float32), IEEE)  # S^T: [keys, rows]
    if SOFTCAP:
        th = tanh_(st * (sm_scale / softcap))
        st = th * (softcap * LOG2E)
    else:
        st = st * (sm_scale * LOG2E)
    pt = tl.exp2(st - lse2[None, :])
    if MASKED:
        vis = tile_visible(offs_m[None, :], offs_n[:, None], qs, qe, ks, ke, dk, dk_inv, causal, inv)
        pt = tl.where(vis & row_ok[None, :], pt, 0.0)
        do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        delta = tl.load(DELTA + h * stride_lh + offs_m, mask=row_ok, other=0.0)
    else:
        do = tl.load(do_ptrs)
        delta = tl.load(DELTA + h * stride_lh + offs_m)
    if UPCAST:
        do = do.to(tl.float32)
    dv_acc = dot_(pt.to(do.dtype), do, dv_acc, IEEE)
    dpt = dot_(vb, tl.trans(do), tl.zeros([kb.shape[0], BLOCK_M], tl.float32), IEEE)
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP:
        dst = dst * (1.0 - th * th)
    dk_acc = dot_(dst.to(qt.dtype), tl.trans(qt), dk_acc, IEEE)
    return dk_acc, dv_acc


@triton.jit
def dq_tile(
    dq, q, do, lse2, delta, K, V, hk, n0, end, offs_m, offs_d, stride_kt, stride_kh, stride_vt, stride_vh,
    qs, qe, ks, ke, dk, dk_inv, causal, inv, sm_scale, softcap,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """One (q block, keys ``[n0, n0 + BLOCK_N)``) step: adds to dq ``[BLOCK_M, d]`` (unscaled)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k_ptrs = K + offs_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :]
    vt_ptrs = V + offs_n[None, :] * stride_vt + hk * stride_vh + offs_d[:, None]
    if MASKED:
        col_ok = offs_n < end
        kb = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
        vt = tl.load(vt_ptrs, mask=col_ok[None, :], other=0.0)
    else:
        kb = tl.load(k_ptrs)
        vt = tl.load(vt_ptrs)
    if UPCAST:
        kb = kb.to(tl.float32)
        vt = vt.to(tl.float32)
    s = dot_(q, tl.trans(kb), tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE)
    if SOFTCAP:
        th = tanh_(s * (sm_scale / softcap))
        s = th * (softcap * LOG2E)
    else:
        s = s * (sm_scale * LOG2E)
    p = tl.exp2(s - lse2[:, None])
    if MASKED:
        vis = tile_visible(offs_m[:, None], offs_n[None, :], qs, qe, ks, ke, dk, dk_inv, causal, inv)
        p = tl.where(vis & col_ok[None, :], p, 0.0)
    dp = dot_(do, vt, tl.zeros([q.shape[0], BLOCK_N], tl.float32), IEEE)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - th * th)
    return dot_(ds.to(kb.dtype), kb, dq, IEEE)


@triton.jit
def kv_program(
    Q, K, V, DO, LSE2, DELTA, DK, DV, SLICES, KB_PTR, KB_IDX, KB_ORDER, hk, kv_rank,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, total_k, sm_scale, softcap,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """A K/V program: the ``kv_rank``-th block (most-work-first order) of kv head ``hk``."""
    offs_d = tl.arange(0, HEAD_DIM)
    blk = tl.load(KB_ORDER + kv_rank)
    n0 = blk * BLOCK_N1
    offs_n = n0 + tl.arange(0, BLOCK_N1)
    col_ok = offs_n < total_k
    kb = tl.load(
        K + offs_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=col_ok[:, None], other=0.0
    )
    vb = tl.load(
        V + offs_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=col_ok[:, None], other=0.0
    )
    if UPCAST:
        kb = kb.to(tl.float32)
        vb = vb.to(tl.float32)
    dk_acc = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
    dv_acc = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
    e0 = tl.load(KB_PTR + blk)
    e1 = tl.load(KB_PTR + blk + 1)
    for e in range(e0, e1):
        qs, qe, ks, ke, dk, dk_inv, causal, inv = load_slice(SLICES, tl.load(KB_IDX + e))
        # walking q rows from keys: the causal band bounds rows below, the inverse-causal one above
        start, end, n_tiles, full_lo, full_hi = slice_walk(
            n0, ks, ke, qs, qe, causal, -dk, inv, -dk_inv, BLOCK_N1, BLOCK_M1
        )
        for g in range(GROUP):
            h = hk * GROUP + g
            # the boundary tiles (both ends) in one loop, then the full ones: two pipelined loops, not three
            # (a third loop tripled the K/V program's register spills: ptxas, sm_90a)
            n_full = full_hi - full_lo
            for j in range(0, n_tiles - n_full):
                i = tl.where(j < full_lo, j, j + n_full)
                dk_acc, dv_acc = dkv_tile(
                    Q, DO, LSE2, DELTA, kb, vb, dk_acc, dv_acc, h, start + i * BLOCK_M1, end, offs_n, offs_d,
                    qs, qe, ks, ke, dk, dk_inv, causal, inv,
                    stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, sm_scale, softcap,
                    BLOCK_M1, True, SOFTCAP, UPCAST, IEEE,
                )  # fmt: skip
            for i in range(full_lo, full_hi):
                dk_acc, dv_acc = dkv_tile(
                    Q, DO, LSE2, DELTA, kb, vb, dk_acc, dv_acc, h, start + i * BLOCK_M1, end, offs_n, offs_d,
                    qs, qe, ks, ke, dk, dk_inv, causal, inv,
                    stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, sm_scale, softcap,
                    BLOCK_M1, False, SOFTCAP, UPCAST, IEEE,
                )  # fmt: skip
    dk_acc = dk_acc * sm_scale
    dk_ptrs = DK + offs_n[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :]
    dv_ptrs = DV + offs_n[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :]
    if ACCUM:
        dk_acc += tl.load(dk_ptrs, mask=col_ok[:, None], other=0.0)
        dv_acc += tl.load(dv_ptrs, mask=col_ok[:, None], other=0.0)
    tl.store(dk_ptrs, dk_acc.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptrs, dv_acc.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def q_program(
    Q, K, V, DO, LSE2, DELTA, DQ, SLICES, QB_PTR, QB_IDX, QB_ORDER, h, q_rank,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    stride_dqt, stride_dqh, total_q, sm_scale, softcap,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """A q program: the ``q_rank``-th block (most-work-first order) of q head ``h``."""
    offs_d = tl.arange(0, HEAD_DIM)
    blk = tl.load(QB_ORDER + q_rank)
    hk = h // GROUP
    m0 = blk * BLOCK_M2
    offs_m = m0 + tl.arange(0, BLOCK_M2)
    row_ok = offs_m < total_q
    q = tl.load(
        Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    do = tl.load(
        DO + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=row_ok[:, None], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = tl.load(LSE2 + h * stride_lh + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + h * stride_lh + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M2, HEAD_DIM], tl.float32)
    e0 = tl.load(QB_PTR + blk)
    e1 = tl.load(QB_PTR + blk + 1)
    for e in range(e0, e1):
        qs, qe, ks, ke, dk, dk_inv, causal, inv = load_slice(SLICES, tl.load(QB_IDX + e))
        start, end, n_tiles, full_lo, full_hi = slice_walk(
            m0, qs, qe, ks, ke, inv, dk_inv, causal, dk, BLOCK_M2, BLOCK_N2
        )
        # the boundary tiles (both ends) in one loop, then the full ones: two pipelined loops, not three
        n_full = full_hi - full_lo
        for j in range(0, n_tiles - n_full):
            i = tl.where(j < full_lo, j, j + n_full)
            dq = dq_tile(
                dq, q, do, lse2, delta, K, V, hk, start + i * BLOCK_N2, end, offs_m, offs_d,
                stride_kt, stride_kh, stride_vt, stride_vh, qs, qe, ks, ke, dk, dk_inv, causal, inv,
                sm_scale, softcap, BLOCK_N2, True, SOFTCAP, UPCAST, IEEE,
            )  # fmt: skip
        for i in range(full_lo, full_hi):
            dq = dq_tile(
                dq, q, do, lse2, delta, K, V, hk, start + i * BLOCK_N2, end, offs_m, offs_d,
                stride_kt, stride_kh, stride_vt, stride_vh, qs, qe, ks, ke, dk, dk_inv, causal, inv,
                sm_scale, softcap, BLOCK_N2, False, SOFTCAP, UPCAST, IEEE,
            )  # fmt: skip
    dq = dq * sm_scale
    dq_ptrs = DQ + offs_m[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :]
    if ACCUM:
        dq += tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# which programs a launch runs: both kinds (one launch), or one kind (the split backward's two launches)
BOTH = tl.constexpr(0)
KV_ONLY = tl.constexpr(1)
Q_ONLY = tl.constexpr(2)


# The mask's block counts and the token counts are not specialised (one compile per ``== 1`` / ``% 16``
# class of each, every step at cp > 1); ``stride_lh`` stays specialised: the launcher pads the lse / delta
# rows to a multiple of 16, so it is always divisible by 16 (aligned vector loads) whatever total_q is.
@triton.jit(do_not_specialize=["total_q", "total_k", "NUM_KB", "NUM_QB"])
def ffa_bwd_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ, DK, DV, SLICES,
    QB_PTR, QB_IDX, QB_ORDER, KB_PTR, KB_IDX, KB_ORDER,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    total_q, total_k, sm_scale, softcap,
    HQ, HK, GROUP, NUM_KB, NUM_QB, HEAD_DIM: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, PROGRAMS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if PROGRAMS == BOTH:
        if HEAD_MAJOR:
            # per kv head: its K/V programs, then the q programs of its GQA group (blocks fastest, as
            # FlexAttention orders them: the programs running together share one head's q / K/V stream in L2)
            per_head = NUM_KB + GROUP * NUM_QB
            z = pid // per_head
            x = pid % per_head
            is_kv = x < NUM_KB
            kv_hk = z
            kv_rank = x
            q_h = z * GROUP + (x - NUM_KB) // NUM_QB
            q_rank = (x - NUM_KB) % NUM_QB
        else:
            # every K/V program first, heads fastest (a GQA group's q programs adjacent)
            is_kv = pid < NUM_KB * HK
            kv_hk = pid % HK
            kv_rank = pid // HK
            q_h = (pid - NUM_KB * HK) % HQ
            q_rank = (pid - NUM_KB * HK) // HQ
    else:
        # one kind per launch (`is_kv` is a compile-time constant, so the other kind is not compiled);
        # head-major keeps a head's stream together, heads fastest starts every head's heaviest blocks first
        is_kv = PROGRAMS == KV_ONLY
        if is_kv:
            num_blocks = NUM_KB
            num_heads = HK
        else:
            num_blocks = NUM_QB
            num_heads = HQ
        if HEAD_MAJOR:
            head = pid // num_blocks
            rank = pid % num_blocks
        else:
            head = pid % num_heads
            rank = pid // num_heads
        kv_hk, kv_rank, q_h, q_rank = head, rank, head, rank
    if is_kv:
        kv_program(
            Q, K, V, DO, LSE2, DELTA, DK, DV, SLICES, KB_PTR, KB_IDX, KB_ORDER, kv_hk, kv_rank,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
            stride_dkt, stride_dkh, stride_dvt, stride_dvh, total_k, sm_scale, softcap,
            GROUP, HEAD_DIM, BLOCK_M1, BLOCK_N1, SOFTCAP, ACCUM, UPCAST, IEEE,
        )  # fmt: skip
    else:
        q_program(
            Q, K, V, DO, LSE2, DELTA, DQ, SLICES, QB_PTR, QB_IDX, QB_ORDER, q_h, q_rank,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lh,
            stride_dqt, stride_dqh, total_q, sm_scale, softcap,
            GROUP, HEAD_DIM, BLOCK_M2, BLOCK_N2, SOFTCAP, ACCUM, UPCAST, IEEE,
        )  # fmt: skip


_ROW_ALIGN = 16  # Triton specialises an int argument on ``% 16 == 0``


def _grad_buffer(buf: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    # fresh gradients are written in the input's dtype straight from the fp32 registers (no fp32 copy)
    if buf is None:
        return alloc(ref.shape, ref.dtype, ref.device)
    if buf.stride(-1) != 1:
        raise ValueError("gradient accumulators must be contiguous in the last dimension for triton")
    return buf


def triton_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    slices: tuple[Slice, ...],
    scale: float,
    softcap: float,
    *,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward on validated inputs. lse/delta float32 ``[total_q, num_heads_q]`` (delta already
    zero on rows with lse -inf). Returns dq/dk/dv: the given float32 buffers (added to) or fresh ones in the
    inputs' dtypes."""
    q, k, v, do = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, do))
    gq, gk, gv = (_grad_buffer(b, r) for b, r in ((dq, q), (dk, k), (dv, v)))
    tq, hq, d = q.shape
    tk, hk, _ = k.shape
    if not (tq and tk and hq):  # nothing attends: fresh gradients are zero, given ones stay as they are
        for given, g in ((dq, gq), (dk, gk), (dv, gv)):
            if given is None:
                g.zero_()
        return gq, gk, gv
    # [heads, rows] so a tile's rows are one contiguous read; lse in base 2 with -inf rows at +inf (P = 0)
    # row stride padded to a multiple of 16: one specialisation of ``stride_lh`` for every total_q
    rows = -(-tq // _ROW_ALIGN) * _ROW_ALIGN
    lse2 = torch.empty(hq, rows, dtype=lse.dtype, device=q.device)
    lse2[:, :tq] = torch.where(torch.isneginf(lse), float("inf"), lse * 1.4426950408889634).t()
    delta_t = torch.empty(hq, rows, dtype=delta.dtype, device=q.device)
    delta_t[:, :tq] = delta.t()
    upcast, ieee = compute_flags(q)
    t = bwd_tiles(q)
    dev = str(q.device)
    kmeta = axis_tiles(slices, tk, t.block_n1, "k", dev)
    qmeta = axis_tiles(slices, tq, t.block_m2, "q", dev)
    args = dict(
        Q=q, K=k, V=v, DO=do, LSE2=lse2, DELTA=delta_t, DQ=gq, DK=gk, DV=gv, SLICES=qmeta.slices,
        QB_PTR=qmeta.ptr, QB_IDX=qmeta.idx, QB_ORDER=qmeta.order,
        KB_PTR=kmeta.ptr, KB_IDX=kmeta.idx, KB_ORDER=kmeta.order,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=do.stride(0), stride_doh=do.stride(1),
        stride_lh=lse2.stride(0), stride_dqt=gq.stride(0), stride_dqh=gq.stride(1),
        stride_dkt=gk.stride(0), stride_dkh=gk.stride(1), stride_dvt=gv.stride(0), stride_dvh=gv.stride(1),
        total_q=tq, total_k=tk, sm_scale=scale, softcap=softcap if softcap > 0 else 1.0,
        HQ=hq, HK=hk, GROUP=hq // hk, NUM_KB=kmeta.num_blocks, NUM_QB=qmeta.num_blocks, HEAD_DIM=d,
        BLOCK_M1=t.block_m1, BLOCK_N1=t.block_n1, BLOCK_M2=t.block_m2, BLOCK_N2=t.block_n2,
        SOFTCAP=softcap > 0, ACCUM=dq is not None, UPCAST=upcast, IEEE=ieee, HEAD_MAJOR=t.head_major,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    n_kv, n_q = hk * kmeta.num_blocks, hq * qmeta.num_blocks
    if t.split:
        # two launches, each compiled for one kind of program (its own registers); still one owner per block
        ffa_bwd_kernel[(n_kv,)](**args, PROGRAMS=1)
        ffa_bwd_kernel[(n_q,)](**args, PROGRAMS=2)
    else:
        ffa_bwd_kernel[(n_kv + n_q,)](**args, PROGRAMS=0)
    return gq, gk, gv
