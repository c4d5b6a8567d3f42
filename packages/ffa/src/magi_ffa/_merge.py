"""The out/lse merge of two partial attention results over disjoint key sets (online-softmax correction).

``merge_out_lse``: torch ops, differentiable, any device and float dtype. ``merge_out_lse_``: the same
merge in place by one fused Triton kernel (``_triton_merge``; CUDA, or the CPU under ``TRITON_INTERPRET=1``),
for accumulate paths that need no autograd. Both ignore the ``out`` of a row whose lse is -inf, even when it
holds garbage (NaN included), and leave rows -inf in both at out 0 / lse -inf.
"""

from __future__ import annotations

import torch


def merge_out_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets (online-softmax correction).

    out_* ``[total_q, num_heads_q, head_dim]``, lse_* ``[total_q, num_heads_q]``; the result is in lse's dtype.
    Rows whose lse is -inf contribute nothing (their out is ignored, even if it holds garbage); rows that are
    -inf in both stay out 0 / lse -inf. Differentiable, NaN-free on empty rows.
    """
    dt = lse_a.dtype
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    s = torch.exp(lse_a - m_safe) + torch.exp(lse_b - m_safe)
    pos = s > 0
    lse = torch.where(pos, m_safe + torch.log(torch.where(pos, s, torch.ones_like(s))), m)
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - lse_safe)[..., None]
    w_b = torch.exp(lse_b - lse_safe)[..., None]
    zero = torch.zeros((), dtype=dt, device=out_a.device)
    out = torch.where(torch.isneginf(lse_a)[..., None], zero, out_a.to(dt) * w_a) + torch.where(
        torch.isneginf(lse_b)[..., None], zero, out_b.to(dt) * w_b
    )
    return out, lse


def merge_out_lse_(
    out: torch.Tensor, lse: torch.Tensor, new_out: torch.Tensor, new_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a partial result into ``(out, lse)`` in place (one fused Triton kernel) and return them.

    Args:
        out: accumulator ``[total_q, num_heads, head_dim]`` (float32, or a 16-bit dtype when one final rounding
            is all that is wanted), contiguous in its last dimension.
        lse: float32 ``[total_q, num_heads]`` natural-log log-sum-exp of ``out``; -inf marks rows with no key
            yet (their ``out`` content is ignored).
        new_out: partial result over other keys, same shape, any float dtype, last dimension contiguous.
        new_lse: its float32 lse ``[total_q, num_heads]``, any strides (a transposed view is fine).

    Rows that are -inf in both stay (0, -inf). Runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1``.
    Not differentiable: use :func:`merge_out_lse` under autograd.
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
    from ._triton_merge import triton_merge_  # late: Triton only when the fused path runs

    return triton_merge_(out, lse, new_out, new_lse)
