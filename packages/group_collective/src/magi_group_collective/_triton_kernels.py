"""Triton kernels for the CUDA path: row copy (gather/scatter), row reduce, log-sum-exp merge.

Imported lazily (only when ``_ops.use_triton`` says so). Under ``TRITON_INTERPRET=1`` they run on CPU
tensors, which is how CI tests them. Rows are ``C`` contiguous elements (trailing dims flattened).
The reductions use one program per output row and read its contributions in a fixed order from a CSR
(``ReduceIndex``), so they are deterministic and need no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._lse_kernel import lse_reduce_kernel
from ._reduce_index import ReduceIndex, acc_dtype

# Copy kernel tile: up to 256 words per row chunk, ~4096 words per program.
_MAX_BLOCK_C = 256
_TILE_WORDS = 4096


@triton.jit
def _copy_rows_kernel(
    src, dst, src_idx, dst_idx, R, C,
    HAS_SRC_IDX: tl.constexpr, HAS_DST_IDX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    if HAS_SRC_IDX:
        s = tl.load(src_idx + rows, mask=rmask, other=0).to(tl.int64)
    else:
        s = rows.to(tl.int64)
    if HAS_DST_IDX:
        d = tl.load(dst_idx + rows, mask=rmask, other=0).to(tl.int64)
    else:
        d = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = rmask[:, None] & (cols < C)[None, :]
    x = tl.load(src + s[:, None] * C + cols[None, :], mask=mask)
    tl.store(dst + d[:, None] * C + cols[None, :], x, mask=mask)


def _as_words(x: torch.Tensor, word: int) -> torch.Tensor:
    """Reinterpret contiguous rows ``[N, C]`` as ``[N, C * itemsize / word]`` integer words."""
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    return x if x.dtype == dtype else x.view(torch.uint8).view(dtype)


def word_size(row_bytes: int, *ptrs: int) -> int:
    """The widest integer word (8, 4, 2 or 1 bytes) that divides a row and aligns every pointer."""
    return next(w for w in (8, 4, 2, 1) if row_bytes % w == 0 and all(p % w == 0 for p in ptrs))


def row_tiles(R: int, C: int) -> tuple[tuple[int, int], int, int]:
    """``(grid, BLOCK_R, BLOCK_C)`` of a row-copy kernel over ``R`` rows of ``C`` words (about
    ``_TILE_WORDS`` words a program)."""
    block_c = min(triton.next_power_of_2(C), _MAX_BLOCK_C)
    block_r = max(1, min(64, _TILE_WORDS // block_c))
    return (triton.cdiv(R, block_r), triton.cdiv(C, block_c)), block_r, block_c


def copy_rows(
    src: torch.Tensor, dst: torch.Tensor, *, src_idx: torch.Tensor | None, dst_idx: torch.Tensor | None
) -> None:
    """``dst[dst_idx[k]] = src[src_idx[k]]`` for contiguous ``[N, C]`` rows; None = identity.

    Copies bit patterns (rows viewed as the widest aligned integer word), so any dtype is exact.
    """
    idx = src_idx if src_idx is not None else dst_idx
    R = idx.numel()
    row_bytes = src.shape[1] * src.element_size()
    if R == 0 or row_bytes == 0:
        return
    word = word_size(row_bytes, src.data_ptr(), dst.data_ptr())
    s, d = _as_words(src, word), _as_words(dst, word)
    C = row_bytes // word
    grid, block_r, block_c = row_tiles(R, C)
    _copy_rows_kernel[grid](
        s, d, idx if src_idx is None else src_idx, idx if dst_idx is None else dst_idx, R, C,
        HAS_SRC_IDX=src_idx is not None, HAS_DST_IDX=dst_idx is not None, BLOCK_R=block_r, BLOCK_C=block_c,
    )  # fmt: skip


@triton.jit
def csr_row_tile(out, touched, ptr, C, ACC: tl.constexpr, BLOCK_C: tl.constexpr):
    """The start of a CSR reduction program (one touched output row ``o``, one tile of ``BLOCK_C`` columns):
    ``(t, o, first, end, cols, cmask, acc)``, ``acc`` the tile of ``out`` row ``o`` in ``ACC``; the reduce
    kernels here and in ``_native_kernels`` then add their rows ``first .. end - 1`` into ``acc``."""
    t = tl.program_id(0)
    o = tl.load(touched + t).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc = tl.load(out + o * C + cols, mask=cmask, other=0).to(ACC)
    return t, o, tl.load(ptr + t), tl.load(ptr + t + 1), cols, cmask, acc


@triton.jit
def _reduce_rows_kernel(
    out, recv, touched, ptr, rows, weight, C,
    HAS_W: tl.constexpr, ACC: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    _, o, start, end, cols, cmask, acc = csr_row_tile(out, touched, ptr, C, ACC, BLOCK_C)
    for k in range(start, end):
        r = tl.load(rows + k).to(tl.int64)
        x = tl.load(recv + r * C + cols, mask=cmask, other=0).to(ACC)
        if HAS_W:
            x = x * tl.load(weight + r).to(ACC)
        acc += x
    tl.store(out + o * C + cols, acc.to(out.dtype.element_ty), mask=cmask)


def tl_acc_dtype(dtype: torch.dtype):
    """The Triton accumulator of a reduction over ``dtype`` rows: :func:`acc_dtype`'s, int64 for integer
    rows (the native implementation reduces those too)."""
    if not dtype.is_floating_point:
        return tl.int64
    return tl.float64 if acc_dtype(dtype) == torch.float64 else tl.float32


def reduce_rows_csr(
    out: torch.Tensor, recv: torch.Tensor, red: ReduceIndex, weight: torch.Tensor | None
) -> None:
    """``out[touched[t]] += Σ_k weight[r_k] · recv[r_k]`` over the CSR rows ``r_k`` of ``t``; fp32/fp64 acc.

    ``out`` ``[N_out, C]`` and ``recv`` ``[R, C]`` contiguous floating, ``recv`` in ``out``'s dtype or a
    narrower one (each row is loaded in its own dtype and widened exactly into the accumulator); ``weight``
    ``[R]`` fp32.
    """
    T, C = red.touched.numel(), out.shape[1]
    if T == 0 or C == 0:
        return
    block_c = min(triton.next_power_of_2(C), 1024)
    _reduce_rows_kernel[(T, triton.cdiv(C, block_c))](
        out, recv, red.touched, red.csr_ptr, red.csr_rows, weight if weight is not None else red.csr_ptr, C,
        HAS_W=weight is not None, ACC=tl_acc_dtype(out.dtype), BLOCK_C=block_c,
    )  # fmt: skip


def lse_reduce_rows_csr(
    out: torch.Tensor, out_lse: torch.Tensor, recv: torch.Tensor, recv_lse: torch.Tensor, red: ReduceIndex
) -> None:
    """Log-sum-exp merge (see ``_ops.lse_reduce_rows``). ``out`` ``[N_out, H, D]``, ``out_lse`` ``[N_out, H]``
    fp32, ``recv`` ``[R, H, D]``, ``recv_lse`` ``[R, H]`` fp32, all contiguous."""
    T, H, D = red.touched.numel(), out.shape[1], out.shape[2]
    if T == 0 or H == 0:
        return
    block_d = min(triton.next_power_of_2(max(D, 1)), 256)
    # one source (the received tensors): no peers, so c_src and deltas are never read
    rows = red.csr_rows
    lse_reduce_kernel[(T, H)](
        recv, recv_lse, out, out_lse, rows, red.touched, red.csr_ptr, rows, rows, H, D, 0, 0, 0, 0, 0,
        UNIT=1, LUNIT=1, PEERS=False, ACC=tl_acc_dtype(out.dtype), BLOCK_D=block_d,
    )  # fmt: skip
