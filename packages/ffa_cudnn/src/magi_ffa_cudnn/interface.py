"""The FFA contract on cuDNN's ``flex_attention``: slices -> row intervals -> ``mask_func`` -> cached mask plan.

Forward and backward run cuDNN's CuTe DSL kernels through the frontend's reusable-plan classes
(``cudnn.flex_attention.execution``, what ``flex_attn_func`` runs beneath its autograd wrapper, so that the
runtime's launchers run with no graph and the backward can start from a FINAL out / lse merged over several
calls), each plan keeping its launches (:mod:`magi_ffa_cudnn._launch`: cuDNN's per-call host work once). The packed problem is one fixed-length sample (BSHD with batch 1), so cuDNN's
sample-local key intervals are our global ones.

Mask semantics, shapes and the accumulate / sink / max-logits behaviour are ``magi_ffa``'s
(:func:`magi_ffa.ffa_fwd`, :func:`magi_ffa.ffa_bwd`); what differs is listed per function.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from magi_ffa import merge_out_lse, merge_out_lse_, merge_sink, sink_grad
from magi_ffa._sink import validate_sink
from magi_ffa.intervals import row_intervals
from magi_ffa.mask_cache import MaskValueCache
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
from ._launch import BackwardLaunch, ForwardLaunch, layout_key
from .mask_func import mask_func_from_intervals

INSTALL_HINT = (
    "magi_ffa_cudnn needs cuDNN's flex_attention: nvidia-cudnn-frontend==1.32.0 with the CuTe DSL "
    '(nvidia-cutlass-dsl[cu13]), CUDA only. Install row "cudnn" (python scripts/install.py cudnn, '
    "docs/install.md: the runtime with magi-ffa-cudnn) pulls both; or install the two pinned names "
    'directly: `pip install nvidia-cudnn-frontend==1.32.0 "nvidia-cutlass-dsl[cu13]"`.'
)

__all__ = [
    "INSTALL_HINT",
    "CudnnMaskPlan",
    "clear_plan_cache",
    "cudnn_available",
    "ffa_bwd",
    "ffa_fwd",
    "flex_flash_attn_func",
    "get_mask_plan",
    "head_dim_supported",
]

_FLEX = None


def _cudnn():
    """``cudnn.flex_attention`` (imported on first use; ImportError with the install hint without it); its
    ``execution`` and ``dispatch`` submodules hold the reusable-plan forward and backward and their launches."""
    global _FLEX
    if _FLEX is not None:
        return _FLEX
    try:
        import cudnn.flex_attention as flex
        from cudnn.flex_attention import dispatch, execution  # noqa: F401  (flex.execution, flex.dispatch)
    except (ImportError, OSError) as e:  # OSError: a frontend whose shared libraries do not load
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
    _FLEX = flex
    return flex


def cudnn_available() -> bool:
    """True when cuDNN's flex_attention imports (says nothing about a usable GPU)."""
    try:
        _cudnn()
    except ImportError:
        return False
    return True


def head_dim_supported(head_dim: int) -> bool:
    """cuDNN flex_attention 1.32.0 takes head dims that are multiples of 8 up to 128, and 256 (q, k, v equal)."""
    return (0 < head_dim <= 128 and head_dim % 8 == 0) or head_dim == 256


_DTYPES = (torch.float16, torch.bfloat16)


def _check_inputs(q, k, v, softmax_scale, softcap, out, lse) -> float:
    """magi_ffa's checks with cuDNN's limits: fp16/bf16, head_dim, no softcap, one CUDA device."""
    validate_qkv(q, k, v, dtypes=_DTYPES)
    if not head_dim_supported(q.shape[2]):
        raise ValueError(
            f"head_dim must be a multiple of 8 up to 128, or 256, on the cuDNN backend, got {q.shape[2]}"
        )
    scale = validate_scalars(softmax_scale, softcap, q.shape[2])
    if softcap != 0:
        raise ValueError(
            f"`softcap` must be 0 on the cuDNN backend (cuDNN flex_attention has no soft-capping), got "
            f"{softcap!r}; use magi_ffa or magi_ffa_fa4 for soft-capped attention"
        )
    if not q.is_cuda:
        raise ValueError(f"q, k, v must be on one CUDA device, got {q.device}, {k.device}, {v.device}")
    validate_out_lse(out, lse, q)
    return scale


@functools.cache
def _arch_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _check_arch(device: torch.device) -> None:
    """cuDNN flex_attention 1.32.0 ships kernels for sm90 (Hopper) and sm100 / sm103 (Blackwell)."""
    major = _arch_major(device.index if device.index is not None else torch.cuda.current_device())
    if major not in (9, 10):
        raise ValueError(
            f"magi_ffa_cudnn needs a Hopper (sm90) or Blackwell (sm100/sm103) GPU, got sm{major}x"
        )


# --------------------------------------------------------------------------------------------- mask plans
@dataclass(frozen=True, slots=True)
class CudnnMaskPlan:
    """cuDNN's mask plan of one mask and geometry, with what the launchers need beside it.

    Attributes:
        mask_plan: ``cudnn.flex_attention.MaskPlan`` (forward and backward payloads).
        nfunc: endpoints per row of the ``mask_func`` it was built from.
        empty_rows: int64 indices on the device of the rows that see no key, or None when there are none
            (their out is set to 0 and lse to -inf after the kernel, whatever it left there: an index fill
            touches those rows only, not the whole output).
        build_seconds: host wall time of the build (intervals, mask_func and cuDNN's plan, synchronized).
        launches: the plan's launchers by layout and options (:mod:`magi_ffa_cudnn._launch`), built on first
            use: cuDNN's per-call host work done once.
    """

    mask_plan: object
    nfunc: int
    empty_rows: torch.Tensor | None
    build_seconds: float
    launches: dict = field(default_factory=dict, compare=False, repr=False)


_PLANS: MaskValueCache[CudnnMaskPlan] = MaskValueCache(env.plan_cache_size())


def get_mask_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike = None,
) -> CudnnMaskPlan:
    """The cached cuDNN plan of this mask for q / k's geometry (heads, head_dim, dtype, sizes, device).

    A plan binds that geometry, so the cache key is the mask's value plus it; the deterministic flag is not
    part of it (cuDNN builds the ordered-reduction payload into the same plan where it needs one). A training
    step that re-plans the same per-rank slices costs a dictionary lookup.
    """
    total_q, total_k = q.shape[0], k.shape[0]
    geometry = (q.shape[1], k.shape[1], q.shape[2], q.dtype)

    def build(qr: torch.Tensor, kr: torch.Tensor, tm: torch.Tensor) -> CudnnMaskPlan:
        flex = _cudnn()
        t0 = time.perf_counter()
        iv = row_intervals(qr, kr, tm, total_q, total_k)
        func = mask_func_from_intervals(iv)
        empty = iv.counts == 0
        # the plan reads only shapes, dtype and device of the sample tensors (it keeps no reference to them)
        qs = q.detach()[None]
        ks = k.detach()[None]
        plan = flex.create_mask_plan(func, qs, ks, ks, build_backward=True) if total_q and total_k else None
        empty_idx = empty.nonzero().flatten()
        torch.cuda.synchronize(q.device)
        rows = empty_idx if empty_idx.numel() else None
        return CudnnMaskPlan(plan, func.shape[1], rows, time.perf_counter() - t0)

    return _PLANS.get(q_ranges, k_ranges, attn_type_map, total_q, total_k, q.device, build, extra=geometry)


def clear_plan_cache() -> None:
    """Drop every cached mask plan (frees their device tensors)."""
    _PLANS.clear()


# ----------------------------------------------------------------------------------------------- kernels
def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when cuDNN's kernels can read it in place (last dim contiguous, 16-byte aligned pointer
    and strides), else a contiguous copy: cuDNN refuses other layouts rather than copying them itself."""
    step = max(1, 16 // t.element_size())
    aligned = (
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s == 0 or s % step == 0 for s in t.stride()[:-1])
    )
    return (
        t
        if aligned
        else t.contiguous()
        if t.data_ptr() % 16 == 0
        else t.clone(memory_format=torch.contiguous_format)
    )


def _forward(q, k, v, plan: CudnnMaskPlan, scale: float, want_max: bool, zero_empty: bool = True):
    """cuDNN forward: out ``[total_q, hq, d]`` (q's dtype), lse fp32 ``[total_q, hq]`` (a transposed view),
    max logits fp32 ``[hq]`` or None. ``zero_empty=False`` leaves the out rows of rows that see no key as the
    kernel left them (lse -inf is still set): for a result only merged into an accumulator."""
    q4, k4, v4 = (_kernel_layout(t)[None] for t in (q, k, v))
    key = ("fwd", layout_key(q4, k4, v4), want_max)
    launch = plan.launches.get(key)
    if launch is None:
        launch = plan.launches[key] = ForwardLaunch(_cudnn(), plan.mask_plan, q4, k4, v4, want_max)
    out4, lse3, max_logit = launch(q4, k4, v4, scale)
    out, lse = out4[0], lse3[0]
    if plan.empty_rows is not None:
        if zero_empty:
            out.index_fill_(0, plan.empty_rows, 0.0)
        lse.index_fill_(1, plan.empty_rows, float("-inf"))
    return out, lse.t(), max_logit


def _backward(do, q, k, v, out, lse, plan: CudnnMaskPlan, scale: float, deterministic: bool, dlse):
    """cuDNN backward from a (possibly merged) out / lse: dq, dk, dv in q's dtype."""
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    out = _kernel_layout(out.to(q.dtype))
    do = _kernel_layout(do.to(q.dtype))
    # A row whose FINAL lse is -inf sees no key in any call, so it is one of this call's empty rows: only then
    # +inf makes every P of its (masked) scores 0 inside a Partial tile instead of exp(-inf - -inf) = NaN.
    # Otherwise the forward's own [hq, total_q] buffer goes back as it is (lse is its transposed view).
    if plan.empty_rows is not None:
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
    tensors = {
        "q": q[None], "k": k[None], "v": v[None], "o": out[None], "do": do[None], "lse": lse.t()[None].contiguous(),
        "dlse": None if dlse is None else dlse.float().t()[None].contiguous(),
    }  # fmt: skip
    key = ("bwd", layout_key(*tensors.values()), scale, bool(deterministic))
    launch = plan.launches.get(key)
    if launch is None:
        sample = {**tensors, "dq": torch.empty_like(tensors["q"]), "dk": torch.empty_like(tensors["k"]),
                  "dv": torch.empty_like(tensors["v"])}  # fmt: skip
        launch = plan.launches[key] = BackwardLaunch(_cudnn(), plan.mask_plan, sample, bool(deterministic))
    dq, dk, dv = launch(tensors, scale)
    return dq[0], dk[0], dv[0]


def _empty_result(q: torch.Tensor, want_max: bool):
    o = torch.zeros_like(q)
    l = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    ml = torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device) if want_max else None
    return o, l, ml


class _CudnnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: CudnnMaskPlan, scale: float, deterministic: bool, want_max: bool):
        out, lse, max_logit = _forward(q, k, v, plan, scale, want_max)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.deterministic = plan, scale, deterministic
        ctx.set_materialize_grads(False)
        if max_logit is None:
            max_logit = torch.empty(0, device=q.device)
        ctx.mark_non_differentiable(max_logit)
        return out, lse, max_logit

    @staticmethod
    def backward(ctx, dout, dlse, _dmax):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None:
            dlse = torch.where(torch.isneginf(lse), 0.0, dlse.float())
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale, ctx.deterministic, dlse)
        return dq, dk, dv, None, None, None, None


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
    """Attention whose mask is the union of slices, on cuDNN flex_attention kernels (forward and backward).

    Args and returns as :func:`magi_ffa.flex_flash_attn_func`, with cuDNN's limits: q, k, v float16 /
    bfloat16 on an sm90 / sm100 GPU, head_dim a multiple of 8 up to 128 or 256, ``softcap`` 0 (anything else
    raises ValueError naming ``softcap``). Max logits come from the forward kernel itself. Differentiable
    with respect to q, k, v and sink (gradients also flow through lse).
    """
    _cudnn()  # first, so that a machine without cuDNN's frontend is told what to install
    scale = _check_inputs(q, k, v, softmax_scale, softcap, out, lse)
    validate_sink(sink, q)
    _check_arch(q.device)
    plan = get_mask_plan(q, k, q_ranges, k_ranges, attn_type_map)
    if q.shape[0] == 0 or k.shape[0] == 0:
        o, l, ml = _empty_result(q, return_max_logits)
        o = o + 0.0 * q.sum() if q.requires_grad else o  # keep the graph: backward returns zeros, not None
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, l, ml = _CudnnFunc.apply(q, k, v, plan, scale, False, return_max_logits)
        l = l.contiguous()
    else:  # no graph needed: skip autograd.Function's bookkeeping
        o, l, ml = _forward(q, k, v, plan, scale, return_max_logits)
        l = l.contiguous()
    if sink is not None:  # differentiable torch ops: the backward receives the resulting dlse
        o, l = merge_sink(o, l, sink)
    extra = (ml,) if return_max_logits else ()
    if out is None:
        return (o, l, *extra)
    if o.requires_grad or l.requires_grad:
        merged, lse_new = merge_out_lse(out, lse, o, l)  # autograd through an accumulating call: torch ops
        out.copy_(merged)
        lse.copy_(lse_new)
        return (out, lse, *extra)
    return (*merge_out_lse_(out, lse, o, l), *extra)


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
    """Forward launcher (no autograd), the contract of :func:`magi_ffa.ffa_fwd` on cuDNN kernels.

    Differences: float16 / bfloat16 on an sm90 / sm100 GPU, head_dim a multiple of 8 up to 128 or 256,
    ``softcap`` must be 0; ``deterministic`` is accepted (the forward is deterministic); the max logits come
    from the kernel. With ``out`` / ``lse`` the result is merged into them in place by one fused kernel
    (:func:`magi_ffa.merge_out_lse_`); ``sink`` is merged into THIS call's result before that merge.

    Returns:
        ``(out, lse)`` (the given accumulators, or out in q's dtype and lse float32 ``[total_q,
        num_heads_q]``); rows that no slice reaches have out 0 and lse -inf. With ``return_max_logits``:
        ``(out, lse, max_logits)``.
    """
    _cudnn()
    scale = _check_inputs(q, k, v, softmax_scale, softcap, out, lse)
    validate_sink(sink, q)
    _check_arch(q.device)
    plan = get_mask_plan(q, k, q_ranges, k_ranges, attn_type_map)
    if q.shape[0] == 0 or k.shape[0] == 0:
        o, l, ml = _empty_result(q, return_max_logits)
        if sink is None and out is not None:
            return (out, lse, *((ml,) if return_max_logits else ()))  # nothing to merge
    else:
        # merged into an accumulator (no sink): the merge ignores rows of -inf lse, so their out needs no zeros
        zero_empty = out is None or sink is not None
        o, l, ml = _forward(q, k, v, plan, scale, return_max_logits, zero_empty)
    if sink is not None:
        o, l = merge_sink(o, l, sink)
    extra = (ml,) if return_max_logits else ()
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
    """Backward launcher (no autograd) for this call's slices, the contract of :func:`magi_ffa.ffa_bwd` on
    cuDNN kernels: gradients from the FINAL (merged) ``out`` / ``lse``, accumulated into fp32 ``dq`` / ``dk``
    / ``dv`` when given (cuDNN writes q's dtype; the accumulation is ours).

    ``deterministic`` selects cuDNN's deterministic backward (bitwise repeatable dq / dk / dv). ``dlse`` is
    the gradient of the final lse (``Delta = rowsum(do * out) - dlse``); with ``sink`` the sinks' gradient
    from these rows is returned as a fourth value.
    """
    _cudnn()
    scale = _check_inputs(q, k, v, softmax_scale, softcap, None, None)
    _check_arch(q.device)
    validate_bwd_inputs(do, out, lse, q, k, dq, dk, dv)
    validate_sink(sink, q)
    validate_dlse(dlse, lse)
    if dlse is not None:
        dlse = torch.where(torch.isneginf(lse), 0.0, dlse.float())  # rows without keys take no gradient
    extra = () if sink is None else (sink_grad(do, out, lse, sink, dlse),)
    plan = get_mask_plan(q, k, q_ranges, k_ranges, attn_type_map)
    if q.shape[0] == 0 or k.shape[0] == 0:
        fresh = [torch.zeros_like(t) for t in (q, k, v)]
        return (*(f if acc is None else acc for f, acc in zip(fresh, (dq, dk, dv))), *extra)
    gq, gk, gv = _backward(do, q, k, v, out, lse, plan, scale, deterministic, dlse)
    res = [g if acc is None else acc.add_(g) for acc, g in ((dq, gq), (dk, gk), (dv, gv))]
    return (res[0], res[1], res[2], *extra)
