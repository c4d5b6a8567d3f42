"""Row gather / scatter / reduce used before and after the all-to-all-v.

Every function works on tensors whose dim 0 is tokens and whose trailing dims are flattened into one row
of ``C`` elements. On CUDA the Triton kernels of ``_triton_kernels`` run (imported lazily); elsewhere
plain torch index ops do. ``MAGI_GROUP_COLLECTIVE_KERNELS`` (``torch`` | ``triton``, read once) overrides
the choice, which lets the Triton path be tested on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from . import env
from ._reduce_index import ReduceIndex, acc_dtype

_HALF = (torch.float16, torch.bfloat16)


@lru_cache(maxsize=1)
def _kernels_override() -> str | None:
    return env.kernels()


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on ``device`` (CUDA by default)."""
    override = _kernels_override()
    if override is not None:
        return override == "triton"
    return device.type == "cuda"


def ranges_index(starts: list[int], sizes: list[int], device: torch.device) -> torch.Tensor:
    """Row ids ``[sum(sizes)]`` int64 of the concatenated ranges ``[start, start + size)``."""
    if not sizes:
        return torch.empty(0, dtype=torch.int64, device=device)
    st = torch.tensor(starts, dtype=torch.int64)
    sz = torch.tensor(sizes, dtype=torch.int64)
    total = int(sz.sum())
    # Row k of range p is start_p + (k - cum_p): subtract each range's shift, repeated over its rows.
    cum = torch.cumsum(sz, 0) - sz
    idx = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(cum - st, sz)
    return idx.to(device)


def is_identity(idx: torch.Tensor, n: int) -> bool:
    """True when ``idx`` is ``arange(n)`` (checked once at plan time, on the host)."""
    return idx.numel() == n and bool(torch.equal(idx.cpu(), torch.arange(n, dtype=idx.dtype)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    # explicit row length: reshape(n, -1) is ambiguous for tensors with zero elements
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[k] = src[idx[k]]``; ``out`` is allocated when None. Shapes ``[N, ...]`` -> ``[len(idx), ...]``."""
    if out is None:
        out = torch.empty((idx.numel(), *src.shape[1:]), dtype=src.dtype, device=src.device)
    if idx.numel() == 0:
        return out
    if use_triton(src.device) and src.is_contiguous() and out.is_contiguous():
        from ._triton_kernels import copy_rows

        copy_rows(_rows(src), _rows(out), src_idx=idx, dst_idx=None)
    else:
        torch.index_select(src, 0, idx, out=out)
    return out


def scatter_rows(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[idx[k]] = src[k]`` (``idx`` has no repeats)."""
    if idx.numel() == 0:
        return
    if use_triton(dst.device) and src.is_contiguous() and dst.is_contiguous():
        from ._triton_kernels import copy_rows

        copy_rows(_rows(src), _rows(dst), src_idx=None, dst_idx=idx)
    else:
        dst.index_copy_(0, idx, src)


def move_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """``dst[dst_idx[k]] = src[src_idx[k]]`` (``dst_idx`` has no repeats), in one pass on CUDA."""
    if src_idx.numel() == 0:
        return
    if use_triton(dst.device) and src.is_contiguous() and dst.is_contiguous():
        from ._triton_kernels import copy_rows

        copy_rows(_rows(src), _rows(dst), src_idx=src_idx, dst_idx=dst_idx)
    else:
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))


def _fixed_order_add(acc: torch.Tensor, red: ReduceIndex, src: torch.Tensor) -> None:
    """``acc[recv_to_touched[k]] += src[k]`` (``acc`` ``[T, ...]``, one row per touched output row; ``src``
    ``[R, ...]`` in ``acc``'s dtype, so each addition rounds once, in that dtype), each
    row's contributions added one at a time in received order (``red.levels``): no atomics, so the same bits
    on every run and device. ``index_add_`` on CUDA adds with atomics, in whatever order they land."""
    for positions, rows in red.levels:
        acc.index_copy_(0, positions, acc.index_select(0, positions) + src.index_select(0, rows))


def reduce_rows(
    out: torch.Tensor,
    recv: torch.Tensor,
    red: ReduceIndex,
    weight: torch.Tensor | None = None,
    deterministic: bool = False,
) -> None:
    """``out[recv_to_out[k]] += weight[k] * recv[k]`` over all k, accumulated in fp32 for fp16/bf16.

    ``weight`` is ``[R]`` fp32 (``avg``: 1 / number of sources of the piece) or None (plain sum).
    ``out`` ``[N_out, ...]`` and ``recv`` ``[R, ...]`` share the trailing shape; ``recv`` has ``out``'s dtype
    or a narrower floating one, widened exactly before any arithmetic, so the bits are those of
    ``recv.to(out.dtype)`` on every path. The Triton kernel
    (one program per output row) adds in a fixed source order always; the torch fallback (no Triton, or
    ``out`` not contiguous) uses ``index_add_`` (atomics on CUDA) unless ``deterministic``, which adds each
    row's sources in received order (bitwise repeatable, and the same bits as CPU ``index_add_``).
    """
    if recv.shape[0] == 0:
        return
    if use_triton(out.device) and out.is_floating_point() and out.is_contiguous():
        from ._triton_kernels import reduce_rows_csr

        reduce_rows_csr(_rows(out), _rows(recv.contiguous()), red, weight)
        return
    src = recv
    if weight is not None:
        # weighted in out's accumulation dtype, not recv's: a narrower recv (fp32 into fp64 out) must get
        # the product a recv of out's dtype gets
        src = src.to(acc_dtype(out.dtype))
        src = src * weight.to(src.dtype).view(-1, *([1] * (src.dim() - 1)))
    if out.dtype in _HALF:
        # One rounding per output element: gather the touched rows, accumulate in fp32, write back.
        acc = out.index_select(0, red.touched).to(torch.float32)
        if deterministic:
            _fixed_order_add(acc, red, src.to(torch.float32))
        else:
            acc.index_add_(0, red.recv_to_touched, src.to(torch.float32))
        out.index_copy_(0, red.touched, acc.to(out.dtype))
    elif deterministic:
        acc = out.index_select(0, red.touched)
        _fixed_order_add(acc, red, src.to(out.dtype))
        out.index_copy_(0, red.touched, acc)
    else:
        out.index_add_(0, red.recv_to_out, src.to(out.dtype))


def lse_reduce_rows(
    out: torch.Tensor,
    out_lse: torch.Tensor,
    recv: torch.Tensor,
    recv_lse: torch.Tensor,
    red: ReduceIndex,
    deterministic: bool = False,
) -> None:
    """Merge received partial attention results into ``out`` / ``out_lse`` in place.

    ``out`` ``[N_out, H, ...]``, ``out_lse`` ``[N_out, H]`` fp32, ``recv`` ``[R, H, ...]``, ``recv_lse``
    ``[R, H]`` fp32. For an output row with terms ``(o_0, l_0) = (out, out_lse)`` and the received
    ``(o_k, l_k)``: ``lse = log Σ exp(l_k)``, ``out = Σ exp(l_k - lse) · o_k``. A term with ``l = -inf``
    has weight 0 (its ``o`` is ignored, even NaN); a row whose terms are all ``-inf`` keeps ``out`` and
    gets ``lse = -inf``. ``deterministic``: the torch fallback sums in a fixed order (as in
    :func:`reduce_rows`); the Triton kernel always does.
    """
    if recv.shape[0] == 0:
        return
    if use_triton(out.device) and out.is_contiguous() and out_lse.is_contiguous():
        from ._triton_kernels import lse_reduce_rows_csr

        H = out_lse.shape[1]
        lse_reduce_rows_csr(
            out.reshape(out.shape[0], H, -1),
            out_lse,
            recv.contiguous().reshape(recv.shape[0], H, -1),
            recv_lse.contiguous(),
            red,
        )
        return
    ninf = float("-inf")
    tidx, ridx = red.touched, red.recv_to_touched
    # Weights in the accumulation dtype (fp64 data gets fp64 weights even though lse is stored fp32).
    adt = acc_dtype(out.dtype)
    lse0 = out_lse.index_select(0, tidx).to(adt)  # [T, H]
    lse_k = recv_lse.to(adt)  # [R, H]
    m = lse0.clone()
    m.scatter_reduce_(0, ridx.view(-1, 1).expand_as(lse_k), lse_k, "amax", include_self=True)
    m_safe = torch.where(m == ninf, torch.zeros_like(m), m)
    s = torch.exp(lse0 - m_safe)
    terms = torch.exp(lse_k - m_safe.index_select(0, ridx))
    if deterministic:
        _fixed_order_add(s, red, terms)
    else:
        s.index_add_(0, ridx, terms)
    lse = m_safe + torch.log(s)  # s == 0 exactly when every term is -inf: lse = -inf, no NaN
    empty = lse == ninf
    lse_safe = torch.where(empty, torch.zeros_like(lse), lse)
    o0 = out.index_select(0, tidx)
    tail = [1] * (out.dim() - 2)
    zero = torch.zeros((), dtype=adt, device=out.device)
    w0 = torch.exp(lse0 - lse_safe).view(*lse0.shape, *tail)
    acc = torch.where(w0 > 0, o0.to(adt) * w0, zero)
    wk = torch.exp(lse_k - lse_safe.index_select(0, ridx)).view(*lse_k.shape, *tail)
    weighted = torch.where(wk > 0, recv.to(adt) * wk, zero)
    if deterministic:
        _fixed_order_add(acc, red, weighted)
    else:
        acc.index_add_(0, ridx, weighted)
    new = torch.where(empty.view(*empty.shape, *tail), o0, acc.to(out.dtype))
    out.index_copy_(0, tidx, new)
    out_lse.index_copy_(0, tidx, lse.to(out_lse.dtype))
