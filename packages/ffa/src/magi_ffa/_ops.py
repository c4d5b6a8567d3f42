"""magi_ffa's two backends on the one FFA contract (:mod:`magi_ffa.contract`): the Triton kernels and the
blockwise torch path, and the package's public functions, which pick one of them per call (``backend=``,
``MAGI_FFA_BACKEND``, or the device / dtype default)."""

from __future__ import annotations

import torch

from . import reference
from ._common import (
    CheckedSlices,
    KernelBackend,
    RangesLike,
    TypeMapLike,
    acc_dtype,
    resolve_backend,
    triton_head_dim_ok,
    validate_qkv,
    validate_scalars,
)
from ._max_logits import head_max, max_logits_pass
from ._merge import merge_out_lse
from .contract import BackendCapability, FFABackend, Launchers, public_functions, register_backend

__all__ = ["TORCH", "TRITON", "ffa_bwd", "ffa_fwd", "ffa_max_logits", "flex_flash_attn_func"]


def _delta(do, out, lse, dlse, q) -> torch.Tensor:
    """``rowsum(do * out) - dlse`` in the accumulator dtype, 0 on rows whose lse is -inf."""
    adt = acc_dtype(q.dtype)
    delta = (do.to(adt) * out.to(adt)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(adt)
    return torch.where(torch.isneginf(lse), torch.zeros_like(delta), delta)


def _triton_forward(q, k, v, slices, scale, softcap, want_max, zero_empty, out=None, lse=None):
    """magi_ffa's Triton forward: fused accumulation into out / lse, the row max in its epilogue."""
    from ._triton_fwd import triton_fwd

    row_max = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if want_max else None
    o, l = triton_fwd(q, k, v, slices, scale, float(softcap), out=out, lse=lse, row_max=row_max)
    return o, l, None if row_max is None else head_max(row_max)


def _triton_backward(do, q, k, v, out, lse, slices, scale, softcap, deterministic, dlse, dq=None, dk=None,
                     dv=None):  # fmt: skip
    """magi_ffa's Triton backward: every gradient block has one owner (no atomics): always deterministic."""
    from ._triton_bwd import triton_bwd

    delta = _delta(do, out, lse, dlse, q)
    gq, gk, gv = triton_bwd(do, q, k, v, lse, delta, slices, scale, softcap, dq=dq, dk=dk, dv=dv)
    return tuple(
        g if buf is not None else g.to(t.dtype) for g, buf, t in ((gq, dq, q), (gk, dk, k), (gv, dv, v))
    )


def _torch_forward(q, k, v, slices, scale, softcap, want_max, zero_empty, out=None, lse=None):
    """magi_ffa's blockwise torch path (any device and float dtype; the reference): merged into ``out`` /
    ``lse`` in place when given (rows it leaves empty are out 0 / lse -inf either way), the row max from
    the same pass."""
    row_max = (
        torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device) if want_max else None
    )
    o, l = reference.fwd_core(q, k, v, slices, scale, float(softcap), row_max=row_max)
    if out is None:
        o = o.to(q.dtype)
    else:
        o2, l2 = merge_out_lse(out, lse, o, l)
        o, l = out.copy_(o2), lse.copy_(l2)
    return o, l, None if row_max is None else head_max(row_max)


def _torch_backward(do, q, k, v, out, lse, slices, scale, softcap, deterministic, dlse, dq=None, dk=None,
                    dv=None):  # fmt: skip
    grads = reference.bwd_core(do, q, k, v, lse, _delta(do, out, lse, dlse, q), slices, scale, softcap)
    return tuple(
        g.to(ref.dtype) if buf is None else buf.add_(g)
        for buf, g, ref in ((dq, grads[0], q), (dk, grads[1], k), (dv, grads[2], v))
    )


def _pow2(d: int) -> bool:
    return triton_head_dim_ok(d)


TRITON = register_backend(
    FFABackend(
        BackendCapability(
            name="triton", title="triton", package="magi_ffa",
            dtypes=(torch.float16, torch.bfloat16, torch.float32),
            head_dim_ok=_pow2, head_dim_rule="a power of two in [16, 256]",
            device="cuda_or_interpret", accumulates=True, requires=(("triton", "triton"),),
            install_hint="pip install triton", priority=20,
        ),
        Launchers(_triton_forward, _triton_backward),
    )
)  # fmt: skip
"""magi_ffa's Triton kernels bound to the contract (any CUDA GPU; the CPU under ``TRITON_INTERPRET=1``)."""

TORCH = register_backend(
    FFABackend(
        BackendCapability(
            name="torch", title="torch", package="magi_ffa",
            dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
            head_dim_ok=lambda d: d > 0, head_dim_rule="positive", device="any", accumulates=True,
        ),
        Launchers(_torch_forward, _torch_backward),
    )
)  # fmt: skip
"""magi_ffa's blockwise torch path bound to the contract (any device and float dtype, slow)."""


def backend_of(q: torch.Tensor, backend: KernelBackend | str | None) -> FFABackend:
    """The magi_ffa backend that runs: ``backend`` when given, else ``MAGI_FFA_BACKEND``, else Triton for CUDA
    fp16/bf16 with a power-of-two head_dim and torch otherwise."""
    return TORCH if resolve_backend(q, backend) == KernelBackend.TORCH else TRITON


flex_flash_attn_func, ffa_fwd, ffa_bwd = public_functions(backend_of, None, selectable=True)
flex_flash_attn_func.__module__ = ffa_fwd.__module__ = ffa_bwd.__module__ = "magi_ffa"


def ffa_fwd_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    checked: CheckedSlices,
    *,
    backend: KernelBackend | str | None = None,
    **kwargs,
) -> tuple[torch.Tensor, ...]:
    """:func:`ffa_fwd` on slices checked once (``magi_ffa.validation.check_slices``): the chosen backend's
    :meth:`~magi_ffa.contract.FFABackend.fwd_checked` (keyword arguments as there)."""
    validate_qkv(q, k, v)
    return backend_of(q, backend).fwd_checked(q, k, v, checked, **kwargs)


def ffa_bwd_checked(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    checked: CheckedSlices,
    *,
    backend: KernelBackend | str | None = None,
    **kwargs,
) -> tuple[torch.Tensor, ...]:
    """:func:`ffa_bwd` on slices checked once: the chosen backend's
    :meth:`~magi_ffa.contract.FFABackend.bwd_checked`."""
    validate_qkv(q, k, v)
    return backend_of(q, backend).bwd_checked(do, q, k, v, out, lse, checked, **kwargs)


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
    from . import env
    from ._call import checked_of

    validate_qkv(q, k, k)
    scale = validate_scalars(softmax_scale, softcap, q.shape[-1])
    checked = checked_of((q_ranges, k_ranges, attn_type_map), q, k)
    with torch.no_grad():
        if backend_of(q, backend) is TORCH:
            return TORCH.fwd_checked(q, k, k, checked, softmax_scale=scale, softcap=softcap,
                                     return_max_logits=True)[2]  # fmt: skip
        if q.dtype not in TRITON.capability.dtypes:
            raise ValueError(
                f"`q` dtype must be float16, bfloat16 or float32 on the triton backend, got {q.dtype}"
            )
        if not q.is_cuda and not env.triton_interpret():
            raise ValueError(
                f"the triton backend needs CUDA tensors (or TRITON_INTERPRET=1), got device {q.device}"
            )
        if not checked.slices or not q.shape[0] or not k.shape[0]:
            return torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device)
        return max_logits_pass(q, k, checked.slices, scale, softcap)
