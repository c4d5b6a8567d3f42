"""``RowIntervals``: the per-row key intervals both interval builders return (torch and Triton).

Its own module below ``intervals`` and ``_intervals_triton`` so that neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RowIntervals:
    """Per-row visible key intervals.

    Attributes:
        starts: int32 ``[total_q, width]``; row ``r``'s intervals are ``[starts[r, i], ends[r, i])`` for
            ``i < counts[r]``, sorted by start, disjoint and non-touching; padding slots hold ``0, 0``.
        ends: int32 ``[total_q, width]``.
        counts: int32 ``[total_q]``, number of intervals of each row (0 = the row sees no key).
        width: the smallest interval count covering every row (``max(counts)``, at least 1 so that kernels
            always have one slot to read).
        total_k: number of key tokens (every ``end <= total_k``).
    """

    starts: torch.Tensor
    ends: torch.Tensor
    counts: torch.Tensor
    width: int
    total_k: int

    @property
    def total_q(self) -> int:
        return self.starts.shape[0]

    def to_dense(self) -> torch.Tensor:
        """Bool ``[total_q, total_k]`` mask (tests and small inspections only)."""
        cols = torch.arange(self.total_k, device=self.starts.device)
        hit = (cols[None, None, :] >= self.starts[:, :, None]) & (cols[None, None, :] < self.ends[:, :, None])
        return hit.any(dim=1)
