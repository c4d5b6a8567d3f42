"""Fused log-sum-exp merge of a partial attention result into an accumulator, in place (one Triton kernel).

A multi-stage attention (context parallelism) computes each query row against several disjoint key sets and
combines the partial results: with ``lse = log(exp(lse_acc) + exp(lse_new))``,
``out = out_acc * exp(lse_acc - lse) + out_new * exp(lse_new - lse)``. One program reads both partials once
and writes the merged row, in fp32 arithmetic whatever the storage dtypes, instead of the six or so
elementwise torch kernels (and their temporaries) the formula costs otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_ROWS = 16


@triton.jit
def _merge_kernel(
    ACC,
    ACC_LSE,
    NEW,
    NEW_LSE,
    num_rows,
    num_heads,
    stride_at,
    stride_ah,
    stride_lat,
    stride_lah,
    stride_nt,
    stride_nh,
    stride_lnt,
    stride_lnh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    t = rows // num_heads
    h = rows % num_heads
    neg_inf = float("-inf")
    lse_a = tl.load(ACC_LSE + t * stride_lat + h * stride_lah, mask=row_ok, other=neg_inf)
    lse_b = tl.load(NEW_LSE + t * stride_lnt + h * stride_lnh, mask=row_ok, other=neg_inf)
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == neg_inf, 0.0, m)
    w_a = tl.exp(lse_a - m_safe)  # exp(-inf) = 0: an empty partial weighs nothing
    w_b = tl.exp(lse_b - m_safe)
    total = w_a + w_b
    has_keys = total > 0.0
    inv = tl.where(has_keys, 1.0 / tl.where(has_keys, total, 1.0), 0.0)
    c_a = w_a * inv
    c_b = w_b * inv
    lse = tl.where(has_keys, m_safe + tl.log(tl.where(has_keys, total, 1.0)), neg_inf)

    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    a_ptr = ACC + t[:, None] * stride_at + h[:, None] * stride_ah + d[None, :]
    b_ptr = NEW + t[:, None] * stride_nt + h[:, None] * stride_nh + d[None, :]
    a = tl.load(a_ptr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr, mask=mask, other=0.0).to(tl.float32)
    # a row whose partial saw no key may hold garbage (even NaN): select, never multiply by 0
    merged = tl.where(c_a[:, None] > 0.0, a * c_a[:, None], 0.0) + tl.where(
        c_b[:, None] > 0.0, b * c_b[:, None], 0.0
    )
    tl.store(a_ptr, merged.to(ACC.dtype.element_ty), mask=mask)
    tl.store(ACC_LSE + t * stride_lat + h * stride_lah, lse, mask=row_ok)


def merge_out_lse_(
    out: torch.Tensor, lse: torch.Tensor, new_out: torch.Tensor, new_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a partial result into ``(out, lse)`` in place and return them.

    Args:
        out: accumulator ``[total_q, num_heads, head_dim]`` (float32, or a 16-bit dtype when one final rounding
            is all that is wanted), contiguous in its last dimension.
        lse: float32 ``[total_q, num_heads]`` natural-log log-sum-exp of ``out``; -inf marks rows with no key
            yet (their ``out`` content is ignored).
        new_out: partial result over other keys, same shape, any float dtype, last dimension contiguous.
        new_lse: its float32 lse ``[total_q, num_heads]``, any strides (a transposed view is fine).

    Rows that are -inf in both stay (0, -inf). Runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``.
    """
    if out.shape != new_out.shape or lse.shape != new_lse.shape or lse.shape != out.shape[:2]:
        raise ValueError(
            f"merge shapes disagree: out {tuple(out.shape)}, lse {tuple(lse.shape)}, "
            f"new_out {tuple(new_out.shape)}, new_lse {tuple(new_lse.shape)}"
        )
    if lse.dtype != torch.float32 or new_lse.dtype != torch.float32:
        raise ValueError(f"lse tensors must be float32, got {lse.dtype} and {new_lse.dtype}")
    if out.stride(-1) != 1 or new_out.stride(-1) != 1:
        raise ValueError("`out` and `new_out` must be contiguous in their last dimension")
    total_q, heads, dim = out.shape
    rows = total_q * heads
    if rows == 0:
        return out, lse
    _merge_kernel[(triton.cdiv(rows, _BLOCK_ROWS),)](
        out, lse, new_out, new_lse, rows, heads,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        new_out.stride(0), new_out.stride(1), new_lse.stride(0), new_lse.stride(1),
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_R=_BLOCK_ROWS,
    )  # fmt: skip
    return out, lse
