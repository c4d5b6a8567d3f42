"""Public entry points: the launchers ``ffa_fwd`` / ``ffa_bwd`` (no autograd) and the autograd- and
``torch.compile``-ready ``flex_flash_attn_func``, dispatching to the Triton kernel or the torch path."""

from __future__ import annotations

import torch

from . import env, reference
from ._common import (
    CheckedSlices,
    KernelBackend,
    RangesLike,
    TypeMapLike,
    acc_dtype,
    as_ranges,
    as_type_map,
    prepare,
    prepare_checked,
    resolve_backend,
    triton_head_dim_ok,
    validate_bwd_inputs,
    validate_dlse,
    validate_out_lse,
    validate_qkv,
    validate_scalars,
)
from ._merge import merge_out_lse
from ._sink import sink_grad, sink_lse, validate_sink
from ._slice import Slice

__all__ = ["ffa_bwd", "ffa_fwd", "ffa_max_logits", "flex_flash_attn_func"]


def _check_triton_ok(q: torch.Tensor) -> None:
    """An explicitly requested Triton backend never falls back silently: say why it cannot run."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the triton backend supports float16/bfloat16/float32, got {q.dtype}; use torch")
    if not triton_head_dim_ok(q.shape[-1]):
        raise ValueError(f"the triton backend needs a power-of-two head_dim in [16, 256], got {q.shape[-1]}")
    if not q.is_cuda and not env.triton_interpret():
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
    backend: KernelBackend | str | None = None,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, ...]:
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
        sink: optional attention sinks, float32 ``[num_sink, num_heads_q]``: every row's softmax also counts
            the logits ``sink[:, h]``, which carry no value (``lse`` includes them; rows that see no key get
            out 0 and a finite lse). Merged into THIS call's result (before the accumulate-mode merge), so a
            multi-call caller passes it to exactly one call. Triton: fused into the kernel's epilogue.
        return_max_logits: also return this call's max logits, float32 ``[num_heads_q]``: per head the
            largest scaled (soft-capped) score over the call's visible pairs (-inf when there are none).
            Triton: the kernel's running row max, reduced per head.

    Returns:
        ``(out, lse)``: out in q's dtype (or the given buffer), lse float32 (float64 for float64), natural log;
        rows that no slice reaches have out 0 and lse -inf (with sinks: the sinks' lse). With
        ``return_max_logits``: ``(out, lse, max_logits)``.
    """
    if resolve_backend(q, backend) == KernelBackend.TORCH:
        return reference.ffa_fwd(
            q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale=softmax_scale, softcap=softcap,
            deterministic=deterministic, out=out, lse=lse, sink=sink, return_max_logits=return_max_logits,
        )  # fmt: skip
    slices, scale = prepare(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    return _triton_fwd_on(q, k, v, slices, scale, softcap, out, lse, sink, return_max_logits)


def ffa_fwd_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    checked: CheckedSlices,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    backend: KernelBackend | str | None = None,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`ffa_fwd` on slices checked once by ``_common.check_slices`` (an internal entry: the attention
    runtime's kernel calls); every other argument is checked as there."""
    slices, scale = prepare_checked(q, k, v, checked, softmax_scale, softcap)
    if resolve_backend(q, backend) == KernelBackend.TORCH:
        return reference.fwd_on_slices(q, k, v, slices, scale, softcap, out=out, lse=lse, sink=sink,
                                       return_max_logits=return_max_logits)  # fmt: skip
    return _triton_fwd_on(q, k, v, slices, scale, softcap, out, lse, sink, return_max_logits)


def _triton_fwd_on(q, k, v, slices, scale, softcap, out, lse, sink, return_max_logits):
    validate_out_lse(out, lse, q)
    validate_sink(sink, q)
    _check_triton_ok(q)
    from ._triton_fwd import triton_fwd

    sl = None if sink is None else sink_lse(sink).contiguous()
    row_max = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_max_logits else None
    o, l = triton_fwd(q, k, v, slices, scale, float(softcap), out=out, lse=lse, sink_lse=sl, row_max=row_max)
    if row_max is None:
        return o, l
    return o, l, head_max(row_max)


def head_max(row_max: torch.Tensor) -> torch.Tensor:
    """``[total_q, num_heads_q]`` row maxima -> float32 ``[num_heads_q]`` (-inf for no rows)."""
    if row_max.shape[0] == 0:
        return torch.full(row_max.shape[1:], float("-inf"), dtype=torch.float32, device=row_max.device)
    return row_max.amax(0).to(torch.float32)


def ffa_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike = None,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: KernelBackend | str | None = None,
) -> torch.Tensor:
    """Max logits alone: float32 ``[num_heads_q]``, per head the largest scaled (soft-capped) score over the
    visible pairs of the slices (-inf when there are none). No gradient.

    The Triton path is one QK pass of the forward kernel without softmax, V or PV (about half a forward's
    FLOPs, no output writes); head dims that are not a power of two are zero-padded (the scores are the
    same). The torch path runs its forward. It is the separate max pass of backends whose kernels do not
    report the max (magi_ffa_fa4).

    Args: as in :func:`ffa_fwd` (k: ``[total_k, num_heads_kv, head_dim]``).
    """
    d = q.shape[-1]
    scale = validate_scalars(softmax_scale, softcap, d)
    validate_qkv(q, k, k)
    use = resolve_backend(q, backend)
    if use == KernelBackend.TRITON and not triton_head_dim_ok(d) and d < 256:
        pad = max(16, 1 << (d - 1).bit_length()) - d  # zero features: the same scores
        q = torch.nn.functional.pad(q, (0, pad))
        k = torch.nn.functional.pad(k, (0, pad))
    with torch.no_grad():
        if use == KernelBackend.TORCH:
            return reference.ffa_fwd(
                q, k, k, q_ranges, k_ranges, attn_type_map, softmax_scale=scale, softcap=softcap,
                return_max_logits=True,
            )[2]  # fmt: skip
        slices, scale = prepare(q, k, k, q_ranges, k_ranges, attn_type_map, scale, softcap)
        _check_triton_ok(q)
        from ._triton_fwd import triton_fwd

        row_max = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        triton_fwd(q, k, k, slices, scale, float(softcap), row_max=row_max, max_only=True)
        return head_max(row_max)


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
    backend: KernelBackend | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward given ``delta = rowsum(do * out) - dlse``; accumulates into dq/dk/dv if given, else returns
    fresh tensors in the input dtype. Every backend is deterministic (``deterministic`` is accepted for API
    compatibility)."""
    delta = torch.where(torch.isneginf(lse), torch.zeros_like(delta), delta).to(acc_dtype(q.dtype))
    if resolve_backend(q, backend) == KernelBackend.TORCH:
        grads = reference.bwd_core(do, q, k, v, lse, delta, slices, scale, softcap)
        res = []
        for buf, g, ref in ((dq, grads[0], q), (dk, grads[1], k), (dv, grads[2], v)):
            res.append(g.to(ref.dtype) if buf is None else buf.add_(g))
        return res[0], res[1], res[2]
    _check_triton_ok(q)
    from ._triton_bwd import triton_bwd

    gq, gk, gv = triton_bwd(do, q, k, v, lse, delta, slices, scale, softcap, dq=dq, dk=dk, dv=dv)
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
    backend: KernelBackend | str | None = None,
    dlse: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Backward launcher (no autograd) for the contribution of this call's slices.

    Args:
        do: ``[total_q, num_heads_q, head_dim]`` gradient of the final output, q's dtype.
        q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap: as in :func:`ffa_fwd`.
        deterministic: accepted for API parity; every backward is bitwise reproducible (each gradient block
            has one owner, no atomics).
        out: the FINAL forward output (merged over every stage), q's shape, q's dtype or float32.
        lse: the FINAL lse ``[total_q, num_heads_q]`` float32 (float64 for float64). Gradients use
            ``P = exp(S - lse)`` and ``Delta = rowsum(do * out)``, so they are exact for this call's keys;
            rows with lse -inf contribute nothing.
        dq: optional float32 (float64 for float64) accumulator of q's shape, added to in place.
        dk: optional accumulator of k's shape, like dq.
        dv: optional accumulator of v's shape, like dq.
        backend: as in :func:`ffa_fwd`.
        dlse: optional gradient of the FINAL lse, ``[total_q, num_heads_q]``: ``Delta = rowsum(do * out) -
            dlse`` (what a differentiable lse needs).
        sink: the sinks the forward used (``[num_sink, num_heads_q]``): also return their gradient from
            these rows, ``dsink[t, h] = -sum_i exp(sink[t, h] - lse_i) * Delta_i`` (sink's dtype). The
            q/k/v gradients need nothing from the sinks (they are in the final lse already); a multi-call
            caller asks for dsink in exactly one call.

    Returns:
        ``(dq, dk, dv)``: the given accumulators, or fresh tensors in the input dtype when None; with
        ``sink``, ``(dq, dk, dv, dsink)``.
    """
    slices, scale = prepare(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap)
    return _bwd_on(
        do, q, k, v, out, lse, slices, scale, softcap, deterministic, dq, dk, dv, backend, dlse, sink
    )


def ffa_bwd_checked(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    checked: CheckedSlices,
    *,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    deterministic: bool = False,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    backend: KernelBackend | str | None = None,
    dlse: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`ffa_bwd` on slices checked once by ``_common.check_slices`` (the internal entry of
    :func:`ffa_fwd_checked`)."""
    slices, scale = prepare_checked(q, k, v, checked, softmax_scale, softcap)
    return _bwd_on(
        do, q, k, v, out, lse, slices, scale, softcap, deterministic, dq, dk, dv, backend, dlse, sink
    )


def _bwd_on(do, q, k, v, out, lse, slices, scale, softcap, deterministic, dq, dk, dv, backend, dlse, sink):
    validate_bwd_inputs(do, out, lse, q, k, dq, dk, dv)
    validate_sink(sink, q)
    delta = _delta(do, out, lse, dlse, q)
    grads = _bwd_delta(
        do, q, k, v, lse, delta, slices, scale, float(softcap), dq, dk, dv, bool(deterministic), backend
    )
    if sink is None:
        return grads
    return (*grads, sink_grad(do, out, lse, sink, delta=delta))


def _delta(do, out, lse, dlse, q) -> torch.Tensor:
    """``rowsum(do * out) - dlse`` in the accumulator dtype (dlse checked: lse's shape)."""
    adt = acc_dtype(q.dtype)
    delta = (do.to(adt) * out.to(adt)).sum(-1)
    validate_dlse(dlse, lse)
    if dlse is not None:
        delta = delta - dlse.to(adt)
    return delta


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
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    res = ffa_fwd(
        q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale=softmax_scale, softcap=softcap,
        deterministic=deterministic, sink=sink, return_max_logits=return_max_logits,
    )  # fmt: skip
    # max logits: [num_heads_q] when asked for, else an empty placeholder (an op's outputs are fixed)
    m = res[2] if return_max_logits else q.new_empty(0, dtype=torch.float32)
    return res[0].contiguous(), res[1].contiguous(), m


@_fwd_op.register_fake
def _fwd_fake(
    q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, deterministic, sink=None,
    return_max_logits=False,
):  # fmt: skip
    m = q.new_empty(q.shape[1] if return_max_logits else 0, dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=acc_dtype(q.dtype)), m


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
    q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, deterministic, sink, _ = inputs
    out, lse, max_logits = output
    ctx.mark_non_differentiable(max_logits)
    ctx.has_sink = sink is not None
    saved_sink = sink if sink is not None else q.new_empty(0)
    ctx.save_for_backward(q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, saved_sink)
    ctx.args = (softmax_scale, softcap, deterministic)


def _fwd_backward(ctx, dout, dlse, _dmax):
    q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, sink = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    # d lse / d s = P, so an lse gradient enters exactly like a shift of Delta
    delta = _delta(dout, out, lse, dlse, q)
    dq, dk, dv = _bwd_op(dout.contiguous(), q, k, v, lse, delta, q_ranges, k_ranges, attn_type_map, *ctx.args)
    dsink = sink_grad(dout, out, lse, sink, delta=delta) if ctx.has_sink else None
    return dq, dk, dv, None, None, None, None, None, None, dsink, None


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
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Attention whose mask is the union of slices ``(q_ranges[i], k_ranges[i], attn_type_map[i])``.

    Args:
        q: ``[total_q, num_heads_q, head_dim]`` float16/bfloat16 (float32/float64 run on the torch path).
        k: ``[total_k, num_heads_kv, head_dim]``; ``num_heads_q % num_heads_kv == 0`` (GQA/MQA).
        v: like k.
        q_ranges: int32 ``[n, 2]`` query ranges (tensor or list); slices may overlap in q, in k and even in
            (query, key) pairs: the mask is their union (a pair covered twice counts once).
        k_ranges: int32 ``[n, 2]`` key ranges.
        attn_type_map: int32 ``[n]``: 0 FULL, 1 CAUSAL (bottom-right aligned), 2 INV_CAUSAL (top-left
            aligned), 3 BI_CAUSAL; or one type / a list of types as ``AttnMaskType`` members or names;
            None = all FULL.
        softmax_scale: default ``head_dim ** -0.5``.
        softcap: if > 0, ``softcap * tanh(score / softcap)``.
        deterministic: accepted for API parity; forward and backward are always bitwise reproducible (no
            atomics).
        out: optional previous partial output (q's dtype or float32) to merge into, in place.
        lse: its float32 ``[total_q, num_heads_q]`` log-sum-exp (float64 for float64 inputs).
        sink: optional attention sinks, float32 ``[num_sink, num_heads_q]`` (differentiable): every row's
            softmax also counts the logits ``sink[:, h]``, which carry no value; ``lse`` includes them, and
            rows no slice reaches get out 0 and a finite lse. In accumulate mode they are merged into this
            call's result before the merge with ``out``/``lse``.
        return_max_logits: also return float32 ``[num_heads_q]`` max logits: per head the largest scaled
            (soft-capped) score over the visible pairs (-inf when there are none; no gradient).

    Returns:
        ``(out, lse)``: out ``[total_q, num_heads_q, head_dim]`` (q's dtype, or the given buffer), lse float32
        (float64 for float64) natural log; rows no slice reaches: out 0, lse -inf. Differentiable in q, k, v
        and sink (and through lse); in accumulate mode, also in the given out/lse. With
        ``return_max_logits``: ``(out, lse, max_logits)``.
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
    validate_sink(sink, q)
    ret_max = bool(return_max_logits)
    o, l, m = _fwd_op(q, k, v, qr, kr, tm, scale, float(softcap), bool(deterministic), sink, ret_max)
    if out is None:
        return (o, l, m) if ret_max else (o, l)
    # autograd saves the previous out/lse for the merge backward: hand it clones, since we overwrite the buffers
    prev_out, prev_lse = (out.clone(), lse.clone()) if torch.is_grad_enabled() else (out, lse)
    o2, l2 = merge_out_lse(prev_out, prev_lse, o, l)
    out.copy_(o2)
    lse.copy_(l2)
    return (out, lse, m) if ret_max else (out, lse)
