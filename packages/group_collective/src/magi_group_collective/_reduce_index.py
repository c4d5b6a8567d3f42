"""``ReduceIndex`` (where each received row is reduced to) and the accumulation dtype of a reduction: the types
the torch row ops (``_ops``) and the Triton kernels (``_triton_kernels``) share, below both."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of a reduction over ``dtype`` data: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, slots=True)
class ReduceIndex:
    """Where each received row is reduced to (device tensors, built once per plan).

    Attributes:
        recv_to_out: ``[R]`` int64, output row of every received row.
        touched: ``[T]`` int64, sorted unique output rows that receive anything.
        recv_to_touched: ``[R]`` int64, position of ``recv_to_out`` in ``touched``.
        csr_ptr: ``[T + 1]`` int64, received rows of ``touched[t]`` are ``csr_rows[csr_ptr[t]:csr_ptr[t+1]]``.
        csr_rows: ``[R]`` int64, received rows sorted by target (stable: source order is kept, so the
            Triton reduction is deterministic).
        levels: the same contributions by rank within their row, for the fixed-order torch reduction: level
            ``j`` is ``(positions, rows)``, ``[T_j]`` int64 each: the positions in ``touched`` that receive a
            ``j``-th row, and that received row (``csr_rows`` order). Every position appears at most once per
            level, so a level adds without atomics, and levels run in order.
    """

    recv_to_out: torch.Tensor
    touched: torch.Tensor
    recv_to_touched: torch.Tensor
    csr_ptr: torch.Tensor
    csr_rows: torch.Tensor
    levels: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    @staticmethod
    def build(recv_to_out: torch.Tensor, device: torch.device) -> ReduceIndex:
        r2o = recv_to_out.cpu()
        touched, inverse, counts = torch.unique(r2o, sorted=True, return_inverse=True, return_counts=True)
        rows = torch.sort(inverse, stable=True).indices
        ptr = torch.zeros(touched.numel() + 1, dtype=torch.int64)
        ptr[1:] = torch.cumsum(counts, 0)
        # rank of each sorted received row inside its target row: 0 for the first source, 1 for the next, ...
        rank_in_row = torch.arange(rows.numel(), dtype=torch.int64) - torch.repeat_interleave(
            ptr[:-1], counts
        )
        target = torch.repeat_interleave(torch.arange(touched.numel(), dtype=torch.int64), counts)
        depth = int(counts.max()) if counts.numel() else 0
        levels = tuple(
            (target[rank_in_row == j].to(device), rows[rank_in_row == j].to(device)) for j in range(depth)
        )
        return ReduceIndex(
            recv_to_out=r2o.to(device),
            touched=touched.to(device),
            recv_to_touched=inverse.to(device),
            csr_ptr=ptr.to(device),
            csr_rows=rows.to(device),
            levels=levels,
        )
