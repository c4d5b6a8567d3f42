"""Tile metadata for the Triton kernels: for every block of rows on one axis, the slices that touch it.

The forward programs and the backward's q programs own one q block (``[b * BLOCK_M, (b + 1) * BLOCK_M)``) and
walk the slices listed for it, so overlapping q slices need no merge pass, no atomics and no locks; the
backward's K/V programs do the same over k blocks. Built on the host from the trimmed slices, cached by
value (the slices tuple), uploaded once per (mask, block size, device).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._slice import Slice


@dataclass(frozen=True, slots=True)
class AxisTiles:
    """CSR of slices per block on one axis (device int32 tensors).

    ``slices``: ``[n, 8]`` rows (q_start, q_end, k_start, k_end, type, dk, dk_inv, 0) of the trimmed slices;
    ``ptr``: ``[num_blocks + 1]`` offsets into ``idx`` (slice ids per block, ascending slice id: a fixed
    accumulation order, hence bitwise determinism); ``order``: ``[num_blocks]`` block ids, most work first
    (long tiles start early, short ones fill the tail).
    """

    slices: torch.Tensor
    ptr: torch.Tensor
    idx: torch.Tensor
    order: torch.Tensor
    num_blocks: int


def slice_table(slices: tuple[Slice, ...]) -> list[list[int]]:
    return [[s.q_start, s.q_end, s.k_start, s.k_end, int(s.attn_type), s.dk, s.dk_inv, 0] for s in slices]


@functools.lru_cache(maxsize=64)
def axis_tiles(slices: tuple[Slice, ...], total: int, block: int, axis: str, device: str) -> AxisTiles:
    """Blocks of ``block`` rows along ``axis`` ("q" or "k") of a ``total``-long axis."""
    nblk = -(-total // block)
    lists: list[list[int]] = [[] for _ in range(nblk)]
    work = [0] * nblk
    for sid, s in enumerate(slices):
        a, b = (s.q_start, s.q_end) if axis == "q" else (s.k_start, s.k_end)
        for blk in range(a // block, (b - 1) // block + 1):
            r0, r1 = max(a, blk * block), min(b, (blk + 1) * block)
            lo, hi = s.k_bounds(r0, r1) if axis == "q" else s.q_bounds(r0, r1)
            if lo < hi:
                lists[blk].append(sid)
                work[blk] += hi - lo
    ptr = [0]
    for lst in lists:
        ptr.append(ptr[-1] + len(lst))
    order = sorted(range(nblk), key=lambda i: -work[i])
    flat = [sid for lst in lists for sid in lst]

    def dev(x, shape=None):
        t = torch.tensor(x, dtype=torch.int32)
        return (t.reshape(shape) if shape else t).to(device)

    return AxisTiles(
        dev(slice_table(slices) or [[0] * 8], (-1, 8)), dev(ptr), dev(flat or [0]), dev(order or [0]), nblk
    )
