"""``flex_flash_attn_func`` on FlashAttention-4: slices -> cached plan -> FA4 block-sparse + mask_mod.

Forward and backward both run FA4's kernels (``flash_attn.cute.interface._flash_attn_fwd`` /
``_flash_attn_bwd``) with: the forward q->k block lists (Full tiles unmasked, Partial tiles masked by the
interval mask_mod, Empty tiles skipped), the backward k->q lists, and the intervals as the aux tensor.
"""

from __future__ import annotations

import functools
import os

import torch

from ._plan import Plan, get_plan
from ._validation import RangesLike, TypeMapLike
from .merge import merge_out_lse_

INSTALL_HINT = (
    "magi_ffa_fa4.flex_flash_attn_func needs FlashAttention-4 (CuTe DSL). Install it with "
    '`pip install "magi-ffa-fa4"` (or `pip install "magi-attention[fa4]"`), which pulls '
    "`flash-attn-4==4.0.0b36` and `nvidia-cutlass-dsl[cu13]`; or install those two pinned names directly: "
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


def _check_inputs(q, k, v, softmax_scale, softcap, out, lse) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise ValueError(f"`{name}` must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"`q` dtype must be float16 or bfloat16 for FA4, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"`k` and `v` must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k/v ({k.shape[2]}) must match")
    if not head_dim_supported(q.shape[2]):
        raise ValueError(
            f"head_dim must be a multiple of 8 and at most 128 on this backend, got {q.shape[2]}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"num_heads_q ({q.shape[1]}) must be a multiple of num_heads_kv ({k.shape[1]})")
    scale = q.shape[2] ** -0.5 if softmax_scale is None else softmax_scale
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"`softmax_scale` must be a positive float or None, got {softmax_scale!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not softcap >= 0:
        raise ValueError(f"`softcap` must be a float >= 0 (0 disables), got {softcap!r}")
    if not q.is_cuda or k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one CUDA device, got {q.device}, {k.device}, {v.device}")
    if (out is None) != (lse is None):
        raise ValueError("`out` and `lse` must be given together (accumulate mode) or both be None")
    if out is not None:
        if out.shape != q.shape or out.dtype not in (q.dtype, torch.float32) or out.device != q.device:
            raise ValueError(
                f"`out` must be {q.dtype} or float32 with q's shape {tuple(q.shape)} on {q.device}, "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
        if lse.shape != q.shape[:2] or lse.dtype != torch.float32 or lse.device != q.device:
            raise ValueError(
                f"`lse` must be float32 of shape {tuple(q.shape[:2])} on {q.device}, "
                f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}"
            )
    return float(scale)


def _forward(q, k, v, plan: Plan, scale: float, softcap: float):
    """FA4 forward; returns out ``[1, total_q, hq, d]`` and lse ``[1, hq, total_q]`` (4-D/3-D FA4 layout)."""
    fa = _fa4()
    q4, k4, v4 = q[None], k[None], v[None]
    # tests set MAGI_FFA_FA4_POISON=1 so that any element the kernel does not write shows up as NaN
    poison = torch.full_like(q4, float("nan")) if os.environ.get("MAGI_FFA_FA4_POISON") == "1" else None
    # a block row with no tile at all may be skipped by the kernel: pre-set its lse to -inf
    lse_buf = None
    if plan.has_empty_rows:
        lse_buf = torch.full((1, q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    out4, lse3, *_ = fa._flash_attn_fwd(
        q4,
        k4,
        v4,
        softmax_scale=scale,
        softcap=softcap,
        mask_mod=plan.mask_mod,
        block_sparse_tensors=plan.fwd_bst,
        aux_tensors=[plan.bounds],
        return_lse=True,
        out=poison,
        lse=lse_buf,
    )
    if plan.has_empty_rows:
        # rows that see no key: output 0 whatever the kernel left there (lse is -inf already)
        out4.masked_fill_(torch.isneginf(lse3).transpose(1, 2)[..., None], 0.0)
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
    def forward(ctx, q, k, v, plan: Plan, scale: float, softcap: float):
        out4, lse3 = _forward(q, k, v, plan, scale, softcap)
        ctx.save_for_backward(q[None], k[None], v[None], out4, lse3)
        ctx.plan, ctx.scale, ctx.softcap = plan, scale, softcap
        ctx.set_materialize_grads(False)
        return out4[0], lse3[0].t()

    @staticmethod
    def backward(ctx, dout, dlse):
        fa = _fa4()
        q4, k4, v4, out4, lse3 = ctx.saved_tensors
        plan: Plan = ctx.plan
        if dout is None:
            dout = torch.zeros_like(out4[0])
        dq, dk, dv = fa._flash_attn_bwd(
            q4,
            k4,
            v4,
            out4,
            dout[None],
            lse3,
            ctx.scale,
            False,
            ctx.softcap,
            mask_mod=plan.mask_mod,
            aux_tensors=[plan.bounds],
            block_sparse_tensors=plan.bwd_bst,
            dlse=None if dlse is None else dlse.t()[None].contiguous(),
        )[:3]
        return dq[0], dk[0], dv[0], None, None, None


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
) -> tuple[torch.Tensor, torch.Tensor]:
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

    Returns:
        ``(out, lse)``: out ``[total_q, num_heads_q, head_dim]`` in q's dtype (or the given ``out``), lse fp32
        ``[total_q, num_heads_q]`` (natural log). Rows that see no key get out 0 and lse -inf.
        Differentiable with respect to q, k and v (gradients also flow through lse).
    """
    _fa4()  # first, so that a machine without FA4 is told what to install
    scale = _check_inputs(q, k, v, softmax_scale, softcap, out, lse)
    _check_arch(q.device)
    plan = get_plan(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0], q.device)
    if q.shape[0] == 0 or k.shape[0] == 0:
        o = torch.zeros_like(q)
        l = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        # keep the graph connected so backward returns zeros rather than None
        o = o + 0.0 * q.sum() if q.requires_grad else o
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, l = _FA4Func.apply(q, k, v, plan, scale, float(softcap))
        l = l.contiguous()
    else:  # no graph needed: skip autograd.Function's bookkeeping (host time per call)
        out4, lse3 = _forward(q, k, v, plan, scale, float(softcap))
        o, l = out4[0], lse3[0].t().contiguous()
    if out is None:
        return o, l
    if o.requires_grad or l.requires_grad:
        # autograd through an accumulating call: the merge must stay in the graph (torch ops)
        merged, lse_new = _merge_differentiable(out, lse, o, l)
        out.copy_(merged)
        lse.copy_(lse_new)
        return out, lse
    return merge_out_lse_(out, lse, o, l)


def _merge_differentiable(out_acc, lse_acc, o, l):
    """Log-sum-exp merge with torch ops (kept for the autograd path); rows -inf in both stay (0, -inf)."""
    lse_new = torch.logaddexp(lse_acc, l)
    safe = torch.where(torch.isneginf(lse_new), 0.0, lse_new)
    w_acc = torch.exp(lse_acc - safe)[..., None]
    w_new = torch.exp(l - safe)[..., None]
    merged = out_acc.float() * w_acc + o.float() * w_new
    return merged, lse_new


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
) -> tuple[torch.Tensor, torch.Tensor]:
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
            is merged into it in place by one fused kernel (:func:`magi_ffa_fa4.merge.merge_out_lse_`).
        lse: float32 ``[total_q, num_heads_q]`` accumulator (natural log), given with ``out``; -inf rows
            ignore ``out``'s content.

    Returns:
        ``(out, lse)``: the given accumulators, or out in q's dtype and lse float32 ``[total_q, num_heads_q]``.
        Rows that no slice reaches have out 0 and lse -inf.
    """
    _fa4()
    scale = _check_inputs(q, k, v, softmax_scale, softcap, out, lse)
    _check_arch(q.device)
    plan = get_plan(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0], q.device)
    if q.shape[0] == 0 or k.shape[0] == 0:
        if out is not None:
            return out, lse
        empty = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        return torch.zeros_like(q), empty
    out4, lse3 = _forward(q, k, v, plan, scale, float(softcap))
    if out is None:
        return out4[0], lse3[0].t().contiguous()
    return merge_out_lse_(out, lse, out4[0], lse3[0].t())


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    Returns:
        ``(dq, dk, dv)``: the given accumulators, or fresh tensors in the input dtype.
    """
    fa = _fa4()
    scale = _check_inputs(q, k, v, softmax_scale, softcap, None, None)
    _check_arch(q.device)
    _check_bwd_buffers(do, out, lse, q, k, dq, dk, dv)
    plan = get_plan(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0], q.device)
    if q.shape[0] == 0 or k.shape[0] == 0:
        fresh = [torch.zeros_like(t) for t in (q, k, v)]
        return tuple(f if b is None else b for f, b in zip(fresh, (dq, dk, dv)))  # type: ignore[return-value]
    gq, gk, gv = fa._flash_attn_bwd(
        q[None],
        k[None],
        v[None],
        out.to(q.dtype)[None],
        do[None],
        lse.t()[None].contiguous(),
        softmax_scale=scale,
        softcap=float(softcap),
        deterministic=bool(deterministic),
        mask_mod=plan.mask_mod,
        aux_tensors=[plan.bounds],
        block_sparse_tensors=plan.bwd_bst,
    )[:3]
    res = []
    for acc, g in ((dq, gq[0]), (dk, gk[0]), (dv, gv[0])):
        res.append(g if acc is None else acc.add_(g))
    return res[0], res[1], res[2]


def _check_bwd_buffers(do, out, lse, q, k, dq, dk, dv) -> None:
    if (
        not isinstance(do, torch.Tensor)
        or do.shape != q.shape
        or do.dtype != q.dtype
        or do.device != q.device
    ):
        raise ValueError(f"`do` must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
    if (
        not isinstance(out, torch.Tensor)
        or out.shape != q.shape
        or out.dtype not in (q.dtype, torch.float32)
        or out.device != q.device
    ):
        raise ValueError(f"`out` must be {q.dtype} or float32 with q's shape {tuple(q.shape)} on {q.device}")
    if not isinstance(lse, torch.Tensor) or lse.shape != q.shape[:2] or lse.dtype != torch.float32:
        raise ValueError(
            f"`lse` must be float32 of shape {tuple(q.shape[:2])}, got {getattr(lse, 'shape', lse)}"
        )
    for name, buf, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, k)):
        if buf is None:
            continue
        if buf.shape != ref.shape or buf.dtype != torch.float32 or buf.device != ref.device:
            raise ValueError(
                f"`{name}` accumulator must be float32 of shape {tuple(ref.shape)} on {ref.device}, "
                f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
            )
