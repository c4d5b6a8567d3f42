"""Max logits alone: one QK pass of magi_ffa's Triton forward kernel without softmax, V or PV (about half a
forward's FLOPs, no output writes). The max-logits pass of backends whose kernels do not report the max."""

from __future__ import annotations

import torch

from ._common import triton_head_dim_ok
from ._slice import Slice


def head_max(row_max: torch.Tensor) -> torch.Tensor:
    """``[total_q, num_heads_q]`` row maxima -> float32 ``[num_heads_q]`` (-inf for no rows)."""
    if row_max.shape[0] == 0:
        return torch.full(row_max.shape[1:], float("-inf"), dtype=torch.float32, device=row_max.device)
    return row_max.amax(0).to(torch.float32)


def max_logits_pass(
    q: torch.Tensor, k: torch.Tensor, slices: tuple[Slice, ...], scale: float, softcap: float
) -> torch.Tensor:
    """Float32 ``[num_heads_q]``: per head the largest scaled (soft-capped) score over the slices' visible
    pairs (-inf when there are none). Checked inputs; head dims that are not a power of two are zero-padded
    (zero features: the same scores)."""
    from ._triton_fwd import triton_fwd

    d = q.shape[-1]
    if not triton_head_dim_ok(d) and d < 256:
        pad = max(16, 1 << (d - 1).bit_length()) - d
        q = torch.nn.functional.pad(q, (0, pad))
        k = torch.nn.functional.pad(k, (0, pad))
    with torch.no_grad():
        row_max = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        triton_fwd(q, k, k, slices, scale, float(softcap), row_max=row_max, max_only=True)
    return head_max(row_max)
