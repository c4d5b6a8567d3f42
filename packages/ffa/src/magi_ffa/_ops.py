"""Public entry points: the launchers ``ffa_fwd`` / ``ffa_bwd`` (no autograd) and the autograd- and
``torch.compile``-ready ``flex_flash_attn_func``, dispatching to the Triton kernel or the torch path."""

from __future__ import annotations

import enum
import os

import torch

from . import reference
from ._common import (
    Backend,
    RangesLike,
    Slice,
    TypeMapLike,
    acc_dtype,
    as_ranges,
    as_type_map,
    merge_out_lse,
    prepare,
    resolve_backend,
    triton_head_dim_ok,
    validate_grad_buffers,
    validate_out_lse,
    validate_qkv,
    validate_scalars,
)

__all__ = ["ffa_bwd", "ffa_fwd", "flex_flash_attn_func"]

BWD_IMPL_ENV = "MAGI_FFA_BWD_IMPL"


class BwdImpl(enum.StrEnum):
    """Triton backward implementation: ``split`` (dq kernel + dkv kernel, deterministic, the default) or
    ``fused`` (one kernel, dq through atomics)."""

    SPLIT = "split"
    FUSED = "fused"


def bwd_impl(deterministic: bool) -> BwdImpl:
    """The backward to run, from ``MAGI_FFA_BWD_IMPL`` (read on every call; unset or empty = split).
    ``fused`` is honoured only when ``deterministic`` is False. Raises ValueError on any other value."""
    raw = os.environ.get(BWD_IMPL_ENV, "").strip().lower()
    if not raw:
        return BwdImpl.SPLIT
    try:
        impl = BwdImpl(raw)
    except ValueError:
        valid = ", ".join(m.value for m in BwdImpl)
        raise ValueError(f"{BWD_IMPL_ENV}={raw!r} is not valid; use one of: {valid}") from None
    return BwdImpl.SPLIT if deterministic else impl


def _check_triton_ok(q: torch.Tensor) -> None:
    """An explicitly requested Triton backend never falls back silently: say why it cannot run."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the triton backend supports float16/bfloat16/float32, got {q.dtype}; use torch")
    if not triton_head_dim_ok(q.shape[-1]):
        raise ValueError(f"the triton backend needs a power-of-two head_dim in [16, 256], got {q.shape[-1]}")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1), got device {q.device}"
        )


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
    backend: Backend | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher (no autograd).

    Args:
        q: ``[total_q, num_heads_q, head_dim]`` float16/bfloat16/float32/float64.
        k: ``[total_k, num_heads_kv, head_dim]``, q's dtype and device; ``num_heads_q % num_heads_kv == 0``.
        v: like k.
        q_ranges: int32 ``[n, 2]`` half-open query ranges (tensor on q's device or the CPU, or a list; CPU
            or lists avoid a device->host sync).
        k_ranges: int32 ``[n, 2]`` key ranges, one per slice.
        attn_type_map: int32 ``[n]`` slice types (0 FULL, 1 CAUSAL, 2 INV_CAUSAL, 3 BI_CAUSAL); None = FULL.
        softmax_scale: score scale, default ``head_dim ** -0.5``.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)``.
        deterministic: accepted for API parity; the forward is always bitwise deterministic (no atomics).
        out: optional accumulator ``[total_q, num_heads_q, head_dim]`` in float32 (float64 for float64 inputs)
            or q's dtype holding a partial result over other keys; merged into in place.
        lse: its log-sum-exp ``[total_q, num_heads_q]`` float32 (float64 for float64 inputs); rows at -inf
            ignore ``out``'s content.
        backend: ``"triton"`` or ``"torch"`` to run that path whatever ``MAGI_FFA_BACKEND`` says (a caller
            that picks its kernels itself); None = ``MAGI_FFA_BACKEND`` or the device/dtype default.

    Returns:
        ``(out, lse)``: out in q's dtype (or the given buffer), lse float32 (float64 for float64), natural log;
        rows that no slice reaches have out 0 and lse -inf.
    """
    if resolve_backend(q, backend) == Backend.TORCH:
        return reference.ffa_fwd(
            q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale=softmax_scale, softcap=softcap,
            deterministic=deterministic, out=out, lse=lse,
        )  # fmt: skip
    slices, scale = prepare(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    validate_out_lse(out, lse, q)
    _check_triton_ok(q)
    from ._triton_fwd import triton_fwd

    return triton_fwd(q, k, v, slices, scale, float(softcap), out=out, lse=lse)


def _bwd_delta(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    slices: tuple[Slice, ...],
    scale: float,
    softcap: float,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    deterministic: bool,
    backend: Backend | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward given ``delta = rowsum(do * out) - dlse``; accumulates into dq/dk/dv if given, else returns
    fresh tensors in the input dtype. The Triton backward is the split dq + dkv pair unless
    ``MAGI_FFA_BWD_IMPL=fused`` and not ``deterministic`` (:func:`bwd_impl`)."""
    impl = bwd_impl(deterministic)  # validated on every backend: a typo never passes silently
    delta = torch.where(torch.isneginf(lse), torch.zeros_like(delta), delta).to(acc_dtype(q.dtype))
    if resolve_backend(q, backend) == Backend.TORCH:
        grads = reference.bwd_core(do, q, k, v, lse, delta, slices, scale, softcap)
        res = []
        for buf, g, ref in ((dq, grads[0], q), (dk, grads[1], k), (dv, grads[2], v)):
            res.append(g.to(ref.dtype) if buf is None else buf.add_(g))
        return res[0], res[1], res[2]
    _check_triton_ok(q)
    if impl == BwdImpl.FUSED:
        from . import _triton_bwd_fused as bwd_mod

        launch = bwd_mod.triton_bwd_fused
    else:
        from . import _triton_bwd as bwd_mod

        launch = bwd_mod.triton_bwd
    gq, gk, gv = launch(do, q, k, v, lse, delta, slices, scale, softcap, dq=dq, dk=dk, dv=dv)
    return (
        gq if dq is not None else gq.to(q.dtype),
        gk if dk is not None else gk.to(k.dtype),
        gv if dv is not None else gv.to(v.dtype),
    )


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
    backend: Backend | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward launcher (no autograd) for the contribution of this call's slices.

    Args:
        do: ``[total_q, num_heads_q, head_dim]`` gradient of the final output, q's dtype.
        q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap: as in :func:`ffa_fwd`.
        deterministic: the default split Triton backward is always bitwise reproducible; with
            ``MAGI_FFA_BWD_IMPL=fused`` (opt-in, dq via atomics) True keeps the split one.
        out: the FINAL forward output (merged over every stage), q's shape, q's dtype or float32.
        lse: the FINAL lse ``[total_q, num_heads_q]`` float32 (float64 for float64). Gradients use
            ``P = exp(S - lse)`` and ``Delta = rowsum(do * out)``, so they are exact for this call's keys;
            rows with lse -inf contribute nothing.
        dq: optional float32 (float64 for float64) accumulator of q's shape, added to in place.
        dk: optional accumulator of k's shape, like dq.
        dv: optional accumulator of v's shape, like dq.
        backend: as in :func:`ffa_fwd`.

    Returns:
        ``(dq, dk, dv)``: the given accumulators, or fresh tensors in the input dtype when None.
    """
    slices, scale = prepare(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    validate_out_lse(out, lse, q)
    if (
        not isinstance(do, torch.Tensor)
        or do.shape != q.shape
        or do.dtype != q.dtype
        or do.device != q.device
    ):
        raise ValueError(f"`do` must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
    validate_grad_buffers(dq, dk, dv, q, k)
    adt = acc_dtype(q.dtype)
    delta = (do.to(adt) * out.to(adt)).sum(-1)
    return _bwd_delta(
        do, q, k, v, lse, delta, slices, scale, float(softcap), dq, dk, dv, bool(deterministic), backend
    )


# ---------------------------------------------------------------------------------------------------------
# torch.library custom ops: functional forward/backward with fake implementations (compile) and autograd.


@torch.library.custom_op("magi_ffa::fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor,
    softmax_scale: float,
    softcap: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, l = ffa_fwd(
        q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale=softmax_scale, softcap=softcap,
        deterministic=deterministic,
    )  # fmt: skip
    return o.contiguous(), l.contiguous()


@_fwd_op.register_fake
def _fwd_fake(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, deterministic):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("magi_ffa::bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor,
    softmax_scale: float,
    softcap: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    slices, scale = prepare(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    dq, dk, dv = _bwd_delta(do, q, k, v, lse, delta, slices, scale, softcap, None, None, None, deterministic)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_bwd_op.register_fake
def _bwd_fake(
    do, q, k, v, lse, delta, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, deterministic
):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup(ctx, inputs, output) -> None:
    q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_ranges, k_ranges, attn_type_map)
    ctx.args = (softmax_scale, softcap, deterministic)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, q_ranges, k_ranges, attn_type_map = ctx.saved_tensors
    adt = acc_dtype(q.dtype)
    if dout is None:
        dout = torch.zeros_like(out)
    # d lse / d s = P, so an lse gradient enters exactly like a shift of Delta
    delta = (dout.to(adt) * out.to(adt)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(adt)
    dq, dk, dv = _bwd_op(dout.contiguous(), q, k, v, lse, delta, q_ranges, k_ranges, attn_type_map, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


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
    deterministic: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention whose mask is the union of slices ``(q_ranges[i], k_ranges[i], attn_type_map[i])``.

    Args:
        q: ``[total_q, num_heads_q, head_dim]`` float16/bfloat16 (float32/float64 run on the torch path).
        k: ``[total_k, num_heads_kv, head_dim]``; ``num_heads_q % num_heads_kv == 0`` (GQA/MQA).
        v: like k.
        q_ranges: int32 ``[n, 2]`` query ranges (tensor or list); slices may overlap in q and in k, but the
            (query, key) areas of two slices must be disjoint.
        k_ranges: int32 ``[n, 2]`` key ranges.
        attn_type_map: int32 ``[n]``: 0 FULL, 1 CAUSAL (bottom-right aligned), 2 INV_CAUSAL (top-left
            aligned), 3 BI_CAUSAL; None = all FULL.
        softmax_scale: default ``head_dim ** -0.5``.
        softcap: if > 0, ``softcap * tanh(score / softcap)``.
        deterministic: forward and the default backward are always bitwise reproducible; it matters only with
            ``MAGI_FFA_BWD_IMPL=fused`` (opt-in fused Triton backward, dq via atomics), which True turns off.
        out: optional previous partial output (q's dtype or float32) to merge into, in place.
        lse: its float32 ``[total_q, num_heads_q]`` log-sum-exp (float64 for float64 inputs).

    Returns:
        ``(out, lse)``: out ``[total_q, num_heads_q, head_dim]`` (q's dtype, or the given buffer), lse float32
        (float64 for float64) natural log; rows no slice reaches: out 0, lse -inf. Differentiable in q, k, v
        (and through lse); in accumulate mode, also in the given out/lse.
    """
    validate_qkv(q, k, v)
    qr = as_ranges(q_ranges, "q_ranges", q.device)
    kr = as_ranges(k_ranges, "k_ranges", q.device)
    tm = as_type_map(attn_type_map, qr.shape[0], q.device)
    if kr.shape[0] != qr.shape[0]:
        raise ValueError(f"`q_ranges` and `k_ranges` must have the same number of slices, got {qr.shape[0]} "
                         f"and {kr.shape[0]}")  # fmt: skip
    scale = validate_scalars(softmax_scale, softcap, q.shape[-1])
    validate_out_lse(out, lse, q)
    o, l = _fwd_op(q, k, v, qr, kr, tm, scale, float(softcap), bool(deterministic))
    if out is None:
        return o, l
    # autograd saves the previous out/lse for the merge backward: hand it clones, since we overwrite the buffers
    prev_out, prev_lse = (out.clone(), lse.clone()) if torch.is_grad_enabled() else (out, lse)
    o2, l2 = merge_out_lse(prev_out, prev_lse, o, l)
    out.copy_(o2)
    lse.copy_(l2)
    return out, lse
