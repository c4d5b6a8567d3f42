"""Fused in-place out/lse merge kernel and its launcher (the public entry is ``magi_ffa.merge_out_lse_``).

A multi-stage attention (context parallelism) computes each query row against several disjoint key sets and
combines the partial results: with ``lse = log(exp(lse_acc) + exp(lse_new))``,
``out = out_acc * exp(lse_acc - lse) + out_new * exp(lse_new - lse)``. One program reads both partials once
and writes the merged rows, in fp32 arithmetic whatever the storage dtypes, instead of the six or so
elementwise torch kernels (and their temporaries) the formula costs otherwise. The per-row math is
``merge_partials``, the same helper the forward kernel's accumulate epilogue uses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import merge_partials

_BLOCK_ROWS = 16


# Row counts and lse strides vary with the token count (an lse given as a transposed ``[heads, rows]`` view
# strides by rows): not specialised, so a new count never compiles a new variant.
@triton.jit(do_not_specialize=["num_rows", "stride_lat", "stride_lah", "stride_lnt", "stride_lnh"])
def merge_out_lse_kernel(
    ACC, ACC_LSE, NEW, NEW_LSE, num_rows, num_heads,
    stride_at, stride_ah, stride_lat, stride_lah, stride_nt, stride_nh, stride_lnt, stride_lnh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    t = rows // num_heads
    h = rows % num_heads
    lse_a = tl.load(ACC_LSE + t * stride_lat + h * stride_lah, mask=row_ok, other=float("-inf"))
    lse_b = tl.load(NEW_LSE + t * stride_lnt + h * stride_lnh, mask=row_ok, other=float("-inf"))
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    a_ptr = ACC + t[:, None] * stride_at + h[:, None] * stride_ah + d[None, :]
    b_ptr = NEW + t[:, None] * stride_nt + h[:, None] * stride_nh + d[None, :]
    a = tl.load(a_ptr, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr, mask=mask, other=0.0).to(tl.float32)
    merged, lse = merge_partials(a, lse_a, b, lse_b)
    tl.store(a_ptr, merged.to(ACC.dtype.element_ty), mask=mask)
    tl.store(ACC_LSE + t * stride_lat + h * stride_lah, lse, mask=row_ok)


def triton_merge_(
    out: torch.Tensor, lse: torch.Tensor, new_out: torch.Tensor, new_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the merge on checked inputs (see ``magi_ffa.merge_out_lse_``)."""
    total_q, heads, dim = out.shape
    rows = total_q * heads
    if rows == 0:
        return out, lse
    merge_out_lse_kernel[(triton.cdiv(rows, _BLOCK_ROWS),)](
        ACC=out, ACC_LSE=lse, NEW=new_out, NEW_LSE=new_lse, num_rows=rows, num_heads=heads,
        stride_at=out.stride(0), stride_ah=out.stride(1), stride_lat=lse.stride(0), stride_lah=lse.stride(1),
        stride_nt=new_out.stride(0), stride_nh=new_out.stride(1), stride_lnt=new_lse.stride(0),
        stride_lnh=new_lse.stride(1), HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_R=_BLOCK_ROWS,
    )  # fmt: skip
    return out, lse
