"""``flex_flash_attn_func`` on FlashAttention-4: slices -> cached launch metadata -> FA4 block-sparse + mask_mod.

Forward and backward both run FA4's kernels (``flash_attn.cute.interface._flash_attn_fwd`` /
``_flash_attn_bwd``) with: the forward q->k block lists (Full tiles unmasked, Partial tiles masked by the
interval mask_mod, Empty tiles skipped), the backward k->q lists, and the intervals as the aux tensor.
"""

from __future__ import annotations

import functools

import torch

from magi_ffa import ffa_max_logits, merge_out_lse, merge_out_lse_, merge_sink, sink_grad
from magi_ffa._sink import validate_sink
from magi_ffa.validation import (
    RangesLike,
    TypeMapLike,
    validate_bwd_inputs,
    validate_dlse,
    validate_out_lse,
    validate_qkv,
    validate_scalars,
)

from . import env
from ._launch_meta import LaunchMeta, get_launch_meta
from ._varlen_kernels import backward_varlen, forward_varlen

INSTALL_HINT = (
    "magi_ffa_fa4.flex_flash_attn_func needs FlashAttention-4 (CuTe DSL): install row "
    '"fa4" (python scripts/install.py fa4, docs/install.md), which pulls `flash-attn-4==4.0.0b36` and '
    "`nvidia-cutlass-dsl[cu13]`; or install those two pinned names directly: "
    '`pip install flash-attn-4==4.0.0b36 "nvidia-cutlass-dsl[cu13]"`.'
)


def fa4_available() -> bool:
    """True when flash-attn-4 and the CuTe DSL import (says nothing about a usable GPU)."""
    try:
        _fa4()
    except ImportError:
        return False
    return True


_FA4_MODULE = None


def _fa4():
    global _FA4_MODULE
    if _FA4_MODULE is not None:
        return _FA4_MODULE
    try:
        from flash_attn.cute import interface as fa4_interface

        from . import _fa4_mask  # noqa: F401  (imports cutlass)
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
    _FA4_MODULE = fa4_interface
    return fa4_interface


def head_dim_supported(head_dim: int) -> bool:
    """FA4 4.0.0b36's block-sparse path (this backend) takes head dims that are multiples of 8, at most 128."""
    return 0 < head_dim <= 128 and head_dim % 8 == 0


_FA4_DTYPES = (torch.float16, torch.bfloat16)


def _check_inputs(q, k, v, softmax_scale, softcap, out, lse) -> float:
    """magi_ffa's checks (``magi_ffa.validation``) with FA4's limits: fp16/bf16, head_dim, one CUDA device."""
    validate_qkv(q, k, v, dtypes=_FA4_DTYPES)
    if not head_dim_supported(q.shape[2]):
        raise ValueError(
            f"head_dim must be a multiple of 8 and at most 128 on this backend, got {q.shape[2]}"
        )
    scale = validate_scalars(softmax_scale, softcap, q.shape[2])
    if not q.is_cuda:
        raise ValueError(f"q, k, v must be on one CUDA device, got {q.device}, {k.device}, {v.device}")
    validate_out_lse(out, lse, q)
    return scale


def _forward(q, k, v, meta: LaunchMeta, scale: float, softcap: float, zero_empty: bool = True):
    """FA4 forward; returns out ``[1, total_q, hq, d]`` and lse ``[1, hq, total_q]`` (4-D/3-D FA4 layout).

    ``zero_empty=False`` leaves whatever the kernel wrote in the out rows of rows that see no key (their lse
    is -inf): for a result that is only merged into an accumulator, whose merge selects such rows away."""
    fa = _fa4()
    if meta.varlen is not None:
        out, lse = forward_varlen(fa, q, k, v, meta.varlen, scale, softcap)
        return out[None], lse[None]
    q4, k4, v4 = q[None], k[None], v[None]
    # tests set MAGI_FFA_FA4_POISON=1 so that any element the kernel does not write shows up as NaN
    poison = torch.full_like(q4, float("nan")) if env.poison() else None
    # a block row with no tile at all may be skipped by the kernel: pre-set its lse to -inf
    lse_buf = None
    if meta.has_empty_rows:
        lse_buf = torch.full((1, q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    out4, lse3, *_ = fa._flash_attn_fwd(
        q4,
        k4,
        v4,
        softmax_scale=scale,
        softcap=softcap,
        mask_mod=meta.mask_mod,
        block_sparse_tensors=meta.fwd_bst,
        aux_tensors=[meta.bounds],
        return_lse=True,
        out=poison,
        lse=lse_buf,
    )
    if meta.has_empty_rows and zero_empty:
        # rows that see no key: output 0 whatever the kernel left there (lse is -inf already)
        out4.index_fill_(1, meta.empty_rows, 0.0)
    return out4, lse3


@functools.cache
def _arch_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _check_arch(device: torch.device) -> None:
    """FA4 4.0.0b36 runs block sparsity forward and backward on sm90 and sm100/sm110 only (its sm80 tiles do
    not match the 128-key sparse blocks; sm120 has no block-sparse backward)."""
    major = _arch_major(device.index if device.index is not None else torch.cuda.current_device())
    if major not in (9, 10, 11):
        raise ValueError(f"magi_ffa_fa4 needs a Hopper (sm90) or Blackwell (sm100/sm110) GPU, got sm{major}x")


class _FA4Func(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta: LaunchMeta, scale: float, softcap: float):
        out4, lse3 = _forward(q, k, v, meta, scale, softcap)
        ctx.save_for_backward(q[None], k[None], v[None], out4, lse3)
        ctx.meta, ctx.scale, ctx.softcap = meta, scale, softcap
        ctx.set_materialize_grads(False)
        return out4[0], lse3[0].t()

    @staticmethod
    def backward(ctx, dout, dlse):
        q4, k4, v4, out4, lse3 = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out4[0])
        if dlse is not None:
            dlse = torch.where(torch.isneginf(lse3[0].t()), 0.0, dlse.float())
        dq, dk, dv = _backward(
            dout, q4[0], k4[0], v4[0], out4[0], lse3[0].t(), ctx.meta, ctx.scale, ctx.softcap, False, dlse
        )
        return dq, dk, dv, None, None, None


def _backward(
    do, q, k, v, out, lse, meta: LaunchMeta, scale: float, softcap: float, deterministic: bool, dlse
):
    """FA4 backward of this call's mask from a (possibly merged) out / lse ``[total_q, hq]``: dq, dk, dv in q's
    dtype. ``dlse``: fp32 ``[total_q, hq]`` or None (0 on rows whose lse is -inf)."""
    fa = _fa4()
    out = out.to(q.dtype)
    if meta.varlen is not None:
        return backward_varlen(fa, do, q, k, v, out, lse, meta.varlen, scale, softcap, deterministic, dlse)
    gq, gk, gv = fa._flash_attn_bwd(
        q[None], k[None], v[None], out[None], do[None], lse.t()[None].contiguous(), softmax_scale=scale,
        softcap=float(softcap), deterministic=bool(deterministic), mask_mod=meta.mask_mod,
        aux_tensors=[meta.bounds], block_sparse_tensors=meta.bwd_bst,
        dlse=None if dlse is None else dlse.t()[None].contiguous(),
    )[:3]  # fmt: skip
    return gq[0], gk[0], gv[0]


def flex_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike = None,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Attention whose mask is the union of slices, on FlashAttention-4 kernels (fwd + bwd).

    Args:
        q: ``[total_q, num_heads_q, head_dim]`` fp16/bf16 on CUDA (head_dim <= 128, multiple of 8).
        k: ``[total_k, num_heads_kv, head_dim]``, same dtype; ``num_heads_q % num_heads_kv == 0`` (query head
            ``h`` uses kv head ``h // (num_heads_q // num_heads_kv)``).
        v: ``[total_k, num_heads_kv, head_dim]``.
        q_ranges: int32 ``[num_slices, 2]`` half-open query ranges (tensor or list of pairs).
        k_ranges: int32 ``[num_slices, 2]`` half-open key ranges.
        attn_type_map: int32 ``[num_slices]``: 0 FULL, 1 CAUSAL (bottom-right aligned), 2 INV_CAUSAL (top-left
            aligned), 3 BI_CAUSAL; None = all FULL. Slices may overlap; the mask is their union.
        softmax_scale: score scale, default ``head_dim ** -0.5``.
        softcap: ``cap * tanh(s / cap)`` on the scaled scores when > 0.
        out: optional accumulator ``[total_q, num_heads_q, head_dim]`` (q's dtype or fp32), given with
            ``lse``; the result is merged into it in place (log-sum-exp weighting) and returned.
        lse: optional fp32 ``[total_q, num_heads_q]`` accumulator, given with ``out``.
        sink: optional attention sinks, fp32 ``[num_sink, num_heads_q]`` (differentiable), as in
            :func:`magi_ffa.flex_flash_attn_func`: merged into the kernel's (out, lse) by a torch epilogue (a
            log-sum-exp merge with a partial of out 0 and lse ``logsumexp_t sink[t, h]``; one elementwise
            pass over out), before any accumulate-mode merge.
        return_max_logits: also return fp32 ``[num_heads_q]`` max logits, from a separate QK pass
            (:func:`magi_ffa.ffa_max_logits` on magi_ffa's Triton kernel: about half a forward's FLOPs more).

    Returns:
        ``(out, lse)``: out ``[total_q, num_heads_q, head_dim]`` in q's dtype (or the given ``out``), lse fp32
        ``[total_q, num_heads_q]`` (natural log). Rows that see no key get out 0 and lse -inf (with sinks:
        a finite lse). Differentiable with respect to q, k, v and sink (gradients also flow through lse).
        With ``return_max_logits``: ``(out, lse, max_logits)``.
    """
    _fa4()  # first, so that a machine without FA4 is told what to install
    scale = _check_inputs(q, k, v, softmax_scale, softcap, out, lse)
    validate_sink(sink, q)
    _check_arch(q.device)
    meta = get_launch_meta(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0], q.device)
    if q.shape[0] == 0 or k.shape[0] == 0:
        o = torch.zeros_like(q)
        l = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        # keep the graph connected so backward returns zeros rather than None
        o = o + 0.0 * q.sum() if q.requires_grad else o
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, l = _FA4Func.apply(q, k, v, meta, scale, float(softcap))
        l = l.contiguous()
    else:  # no graph needed: skip autograd.Function's bookkeeping (host time per call)
        out4, lse3 = _forward(q, k, v, meta, scale, float(softcap))
        o, l = out4[0], lse3[0].t().contiguous()
    if sink is not None:  # differentiable torch ops: FA4's backward receives the resulting dlse
        o, l = merge_sink(o, l, sink)
    extra = (
        (_max_logits(q, k, q_ranges, k_ranges, attn_type_map, scale, softcap),) if return_max_logits else ()
    )
    if out is None:
        return (o, l, *extra)
    if o.requires_grad or l.requires_grad:
        # autograd through an accumulating call: the merge must stay in the graph (torch ops)
        merged, lse_new = merge_out_lse(out, lse, o, l)
        out.copy_(merged)
        lse.copy_(lse_new)
        return (out, lse, *extra)
    return (*merge_out_lse_(out, lse, o, l), *extra)


def _max_logits(q, k, q_ranges, k_ranges, attn_type_map, scale: float, softcap: float) -> torch.Tensor:
    """FA4 reports no max: a separate QK pass on magi_ffa's Triton kernel (head_dim zero-padded to a power
    of two when needed)."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device)
    return ffa_max_logits(
        q.detach(), k.detach(), q_ranges, k_ranges, attn_type_map, softmax_scale=scale, softcap=softcap,
        backend="triton",
    )  # fmt: skip


# The autograd path's merge is magi_ffa's (torch ops, differentiable; a -inf row's out is ignored, NaN included).
_merge_differentiable = merge_out_lse


def ffa_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike = None,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Forward launcher (no autograd), the contract of ``magi_ffa.ffa_fwd`` on FA4 kernels.

    Args:
        q: ``[total_q, num_heads_q, head_dim]`` fp16/bf16 on an sm90/sm100 GPU (head_dim <= 128, multiple of 8).
        k: ``[total_k, num_heads_kv, head_dim]``, same dtype; ``num_heads_q % num_heads_kv == 0``. Any strides
            with a contiguous last dimension (e.g. a view into a fused K/V buffer).
        v: like k.
        q_ranges, k_ranges: int32 ``[num_slices, 2]`` half-open ranges (tensors on the CPU or q's device, or
            lists); the mask is the union of the slices.
        attn_type_map: int32 ``[num_slices]``: 0 FULL, 1 CAUSAL, 2 INV_CAUSAL, 3 BI_CAUSAL; None = all FULL.
        softmax_scale: score scale, default ``head_dim ** -0.5``.
        softcap: ``cap * tanh(s / cap)`` on the scaled scores when > 0.
        deterministic: accepted for parity; the forward is deterministic.
        out: optional accumulator ``[total_q, num_heads_q, head_dim]`` (float32, or q's dtype for a single
            final rounding) holding a partial result over other keys, given with ``lse``; this call's result
            is merged into it in place by one fused kernel (:func:`magi_ffa.merge_out_lse_`).
        lse: float32 ``[total_q, num_heads_q]`` accumulator (natural log), given with ``out``; -inf rows
            ignore ``out``'s content.
        sink: optional fp32 ``[num_sink, num_heads_q]`` attention sinks, merged into THIS call's result (a
            torch epilogue) before the accumulate-mode merge, as in :func:`magi_ffa.ffa_fwd`.
        return_max_logits: also return this call's fp32 ``[num_heads_q]`` max logits (a separate QK pass,
            :func:`magi_ffa.ffa_max_logits`).

    Returns:
        ``(out, lse)``: the given accumulators, or out in q's dtype and lse float32 ``[total_q, num_heads_q]``.
        Rows that no slice reaches have out 0 and lse -inf. With ``return_max_logits``: ``(out, lse,
        max_logits)``.
    """
    _fa4()
    scale = _check_inputs(q, k, v, softmax_scale, softcap, out, lse)
    validate_sink(sink, q)
    _check_arch(q.device)
    meta = get_launch_meta(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0], q.device)
    extra = (
        (_max_logits(q, k, q_ranges, k_ranges, attn_type_map, scale, softcap),) if return_max_logits else ()
    )
    if q.shape[0] == 0 or k.shape[0] == 0:
        o = torch.zeros_like(q)
        l = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        if sink is None and out is not None:
            return (out, lse, *extra)  # nothing to merge
    else:
        # merged into an accumulator (no sink): the merge ignores rows of -inf lse, so their out needs no zeros
        zero_empty = out is None or sink is not None
        out4, lse3 = _forward(q, k, v, meta, scale, float(softcap), zero_empty)
        o, l = out4[0], lse3[0].t()
    if sink is not None:
        o, l = merge_sink(o, l, sink)
    if out is None:
        return (o, l.contiguous(), *extra)
    return (*merge_out_lse_(out, lse, o, l), *extra)


def ffa_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike = None,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward launcher (no autograd) for the contribution of this call's slices, the contract of
    ``magi_ffa.ffa_bwd`` on FA4 kernels.

    Args:
        do: ``[total_q, num_heads_q, head_dim]`` gradient of the final output, q's dtype.
        q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap: as in :func:`ffa_fwd`.
        out: the FINAL forward output (merged over every stage), q's shape, q's dtype or float32.
        lse: the FINAL float32 lse ``[total_q, num_heads_q]``. Gradients use ``P = exp(S - lse)`` and
            ``Delta = rowsum(do * out)``, so they are exact for this call's keys; rows at -inf contribute 0.
        deterministic: FA4's deterministic backward (ordered dQ / GQA dK, dV accumulation).
        dq, dk, dv: optional float32 accumulators of q's / k's / v's shape, added to in place.
        dlse: optional fp32 gradient of the FINAL lse ``[total_q, num_heads_q]`` (FA4's ``dlse``:
            ``Delta = rowsum(do * out) - dlse``).
        sink: the sinks the forward used: also return their gradient from these rows (torch, as in
            :func:`magi_ffa.ffa_bwd`).

    Returns:
        ``(dq, dk, dv)``: the given accumulators, or fresh tensors in the input dtype; with ``sink``,
        ``(dq, dk, dv, dsink)``.
    """
    _fa4()
    scale = _check_inputs(q, k, v, softmax_scale, softcap, None, None)
    _check_arch(q.device)
    validate_bwd_inputs(do, out, lse, q, k, dq, dk, dv)
    validate_sink(sink, q)
    validate_dlse(dlse, lse)
    if dlse is not None:
        dlse = torch.where(torch.isneginf(lse), 0.0, dlse.float())  # rows without keys take no gradient
    extra = () if sink is None else (sink_grad(do, out, lse, sink, dlse),)
    meta = get_launch_meta(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0], q.device)
    if q.shape[0] == 0 or k.shape[0] == 0:
        fresh = [torch.zeros_like(t) for t in (q, k, v)]
        res0 = tuple(f if b is None else b for f, b in zip(fresh, (dq, dk, dv)))
        return (*res0, *extra)
    gq, gk, gv = _backward(do, q, k, v, out, lse, meta, scale, softcap, deterministic, dlse)
    res = []
    for acc, g in ((dq, gq), (dk, gk), (dv, gv)):
        res.append(g if acc is None else acc.add_(g))
    return (res[0], res[1], res[2], *extra)
