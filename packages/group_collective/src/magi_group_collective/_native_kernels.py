"""Triton kernels of the native group collectives: read rows straight from the ranks' symmetric buffers.

Addressing: every kernel gets this rank's buffer as a tensor (``base``, any element type) and
``deltas[p]``, the distance from it to rank ``p``'s buffer in units of ``UNIT_BYTES``: a ``SymSpace`` (see
``_symmetric``), which the host wrappers take whole.
Row ``r`` of rank ``p``'s staging slot starts at element ``deltas[p] * UNIT + slot + r * C`` of ``base``;
a row of this rank's own ``input`` (pieces a rank sends to itself are never staged) at
``in_delta + r * C``, ``in_delta`` being the distance from ``base`` to ``input``. Everything is plain
pointer arithmetic on one base, so the same kernels run under ``TRITON_INTERPRET=1`` on CPU tensors that
stand for the ranks' buffers (how the tests check the index math), and on the GPU where ``base + offset``
lands in a peer's memory mapped into this process.

GroupCast copies bit patterns (rows viewed as integer words), so any dtype arrives exact. GroupReduce
accumulates in fp32 (fp64 for fp64 data, int64 for integers) and visits the contributions of an output row
in increasing source rank, the order of the all-to-all-v path's reduction, with the same operations: both
paths give the same bits for the same inputs, and repeated runs are bitwise identical (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._lse_kernel import lse_reduce_kernel
from ._native_plan import UNIT_BYTES
from ._symmetric import SymSpace
from ._triton_kernels import _as_words, csr_row_tile, row_tiles, tl_acc_dtype, word_size

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _pull_rows_kernel(
    base, out, deltas, src_rank, src_row, R, C, me, in_delta, slot,
    UNIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    s = tl.load(src_rank + rows, mask=rmask, other=0)
    r = tl.load(src_row + rows, mask=rmask, other=0).to(tl.int64)
    d = tl.load(deltas + s, mask=rmask, other=0).to(tl.int64) * UNIT
    start = tl.where(s == me, in_delta, d + slot) + r * C
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = rmask[:, None] & (cols < C)[None, :]
    x = tl.load(base + start[:, None] + cols[None, :], mask=mask)
    tl.store(out + rows.to(tl.int64)[:, None] * C + cols[None, :], x, mask=mask)


def pull_rows(
    space: SymSpace,
    slot: int,
    input: torch.Tensor,
    out: torch.Tensor,
    src_rank: torch.Tensor,
    src_row: torch.Tensor,
) -> None:
    """``out[k] = row src_row[k] of rank src_rank[k]`` (its staging slot at byte ``slot`` of its buffer in
    ``space``, or ``input`` for this rank). ``input`` / ``out`` contiguous ``[N, C]`` rows of one dtype."""
    base, deltas, me = space.local, space.deltas, space.rank
    R = src_rank.numel()
    row_bytes = out.shape[1] * out.element_size()
    if R == 0 or row_bytes == 0:
        return
    word = word_size(row_bytes, input.data_ptr(), out.data_ptr(), base.data_ptr())
    b = base.view(_WORD_DTYPES[word])
    i, o = _as_words(input, word), _as_words(out, word)
    C = row_bytes // word
    grid, block_r, block_c = row_tiles(R, C)
    _pull_rows_kernel[grid](
        b, o, deltas, src_rank, src_row, R, C, me, (i.data_ptr() - b.data_ptr()) // word, slot // word,
        UNIT=UNIT_BYTES // word, BLOCK_R=block_r, BLOCK_C=block_c,
    )  # fmt: skip


@triton.jit
def _pull_reduce_kernel(
    base, out, deltas, touched, ptr, c_src, c_row, weight, C, me, in_delta, slot,
    UNIT: tl.constexpr, HAS_W: tl.constexpr, ACC: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    t, o, start, end, cols, cmask, acc = csr_row_tile(out, touched, ptr, C, ACC, BLOCK_C)
    if HAS_W:
        w = tl.load(weight + t).to(ACC)
    for k in range(start, end):
        s = tl.load(c_src + k)
        r = tl.load(c_row + k).to(tl.int64)
        d = tl.load(deltas + s).to(tl.int64) * UNIT
        row = tl.where(s == me, in_delta, d + slot) + r * C
        x = tl.load(base + row + cols, mask=cmask, other=0).to(ACC)
        if HAS_W:
            x = x * w
        acc += x
    tl.store(out + o * C + cols, acc.to(out.dtype.element_ty), mask=cmask)


def pull_reduce(
    space: SymSpace,
    slot: int,
    input: torch.Tensor,
    out: torch.Tensor,
    csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    weight: torch.Tensor | None,
) -> None:
    """``out[touched[t]] += Σ_k weight[t] · row c_row[k] of rank c_src[k]`` over the CSR entries of ``t``
    (``csr = (touched, ptr, c_src, c_row)``; staged rows at byte ``slot`` of the ranks' buffers in ``space``).

    ``input`` / ``out`` contiguous ``[N, C]`` rows of one real dtype; ``weight`` ``[T]`` fp32 or None.
    """
    base, deltas, me = space.local, space.deltas, space.rank
    touched, ptr, c_src, c_row = csr
    T, C = touched.numel(), out.shape[1]
    if T == 0 or C == 0:
        return
    es = out.element_size()
    b = base.view(out.dtype)
    block_c = min(triton.next_power_of_2(C), 1024)
    _pull_reduce_kernel[(T, triton.cdiv(C, block_c))](
        b, out, deltas, touched, ptr, c_src, c_row, weight if weight is not None else ptr, C, me,
        (input.data_ptr() - b.data_ptr()) // es, slot // es,
        UNIT=UNIT_BYTES // es, HAS_W=weight is not None, ACC=tl_acc_dtype(out.dtype), BLOCK_C=block_c,
    )  # fmt: skip


def pull_lse_reduce(
    space: SymSpace,
    slot: int,
    lse_slot: int,
    input: torch.Tensor,
    input_lse: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor,
    csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Log-sum-exp merge of the contributions into ``out`` / ``out_lse`` (see ``_ops.lse_reduce_rows``), over
    the CSR entries ``csr = (touched, ptr, c_src, c_row)`` as in :func:`pull_reduce`.

    ``input`` / ``out`` contiguous ``[N, H, D]`` floating, ``input_lse`` / ``out_lse`` ``[N, H]`` fp32; the
    staged lse rows of rank ``p`` are at byte ``lse_slot`` of its buffer in ``space``, the data rows at ``slot``.
    """
    base, deltas, me = space.local, space.deltas, space.rank
    touched, ptr, c_src, c_row = csr
    T, H, D = touched.numel(), out.shape[1], out.shape[2]
    if T == 0 or H == 0:
        return
    es = out.element_size()
    b, lb = base.view(out.dtype), base.view(torch.float32)
    block_d = min(triton.next_power_of_2(max(D, 1)), 256)
    lse_reduce_kernel[(T, H)](
        b, lb, out, out_lse, deltas, touched, ptr, c_src, c_row, H, D, me,
        (input.data_ptr() - b.data_ptr()) // es, (input_lse.data_ptr() - lb.data_ptr()) // 4, slot // es,
        lse_slot // 4, UNIT=UNIT_BYTES // es, LUNIT=UNIT_BYTES // 4, PEERS=True, ACC=tl_acc_dtype(out.dtype),
        BLOCK_D=block_d,
    )  # fmt: skip
