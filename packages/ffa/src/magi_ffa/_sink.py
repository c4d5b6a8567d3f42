"""Attention sinks and max logits: the pieces every backend shares (torch, cheap, O(total_q x heads)).

A sink is an extra logit per head that joins every query row's softmax and carries no value. With
``sink`` ``[num_sink, num_heads_q]``, row ``i`` of head ``h`` has ``lse_i = log(sum_j exp(s_ij) + sum_t
exp(sink[t, h]))`` and ``out_i = sum_j exp(s_ij - lse_i) v_j``. That is exactly the log-sum-exp merge of the
attention's partial result with a partial whose out is 0 and whose lse is ``logsumexp_t sink[t, h]``
(:func:`sink_lse`), so several sinks act as one, and a row that sees no key gets out 0 and a finite lse.

The backward needs only the final (out, lse): for real keys ``P = exp(S - lse)`` and ``Delta = rowsum(dO *
O) - dlse`` are unchanged (the kernels' usual backward on the final out/lse), and
``dsink[t, h] = -sum_i exp(sink[t, h] - lse_i) * Delta_i`` (:func:`sink_grad`).
"""

from __future__ import annotations

import torch

__all__ = ["merge_sink", "sink_grad", "sink_lse", "validate_sink"]


def validate_sink(sink: torch.Tensor | None, q: torch.Tensor, name: str = "sink") -> None:
    """``sink`` must be None or a float32 (float64 allowed) ``[num_sink, num_heads_q]`` tensor on q's device,
    ``num_sink >= 1``."""
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor or None, got {type(sink).__name__}")
    if sink.ndim != 2 or sink.shape[1] != q.shape[1] or sink.shape[0] < 1:
        raise ValueError(
            f"`{name}` must have shape [num_sink >= 1, num_heads_q={q.shape[1]}], got {tuple(sink.shape)}"
        )
    if sink.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"`{name}` must be float32 (or float64), got {sink.dtype}")
    if sink.device != q.device:
        raise ValueError(f"`{name}` must be on q's device {q.device}, got {sink.device}")


def sink_lse(sink: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[num_heads_q]`` log-sum-exp of the sinks of each head, in ``dtype`` (the lse dtype)."""
    return torch.logsumexp(sink.to(dtype), dim=0)


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the sinks into a final (out ``[total_q, num_heads_q, head_dim]``, lse ``[total_q,
    num_heads_q]``) with torch ops (differentiable in out, lse and sink); returns new tensors, out in out's
    dtype, lse in lse's dtype. Rows at lse -inf get out 0 and lse ``logsumexp_t sink[t, h]``."""
    ls = sink_lse(sink, lse.dtype)[None]
    new = torch.logaddexp(lse, ls)
    new_safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    coef = torch.exp(lse - new_safe)  # 0 where lse is -inf: no NaN, no gradient
    out_new = torch.where(coef[..., None] > 0, out * coef.to(out.dtype)[..., None], torch.zeros_like(out))
    return out_new, new


def sink_grad(
    do: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sink: torch.Tensor,
    dlse: torch.Tensor | None = None,
    *,
    delta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of the sinks from the FINAL (out, lse) of these query rows (sinks included):
    ``dsink[t, h] = -sum_i exp(sink[t, h] - lse_i) * (rowsum(do_i * out_i) - dlse_i)``, in sink's dtype.

    ``delta`` (``rowsum(do * out) - dlse``, lse's dtype) may be passed instead of computing it. Memory is
    O(total_q x heads): rows are weighted relative to the smallest lse of each head (no overflow, since
    every lse includes the sinks)."""
    adt = lse.dtype
    if delta is None:
        delta = (do.to(adt) * out.to(adt)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(adt)
    fin = torch.isfinite(lse)
    base = torch.where(fin, lse, torch.full_like(lse, float("inf"))).amin(0)  # [hq]
    base = torch.where(torch.isfinite(base), base, torch.zeros_like(base))
    lse_safe = torch.where(fin, lse, base.expand_as(lse))
    w = torch.where(fin, torch.exp(base - lse_safe) * delta.to(adt), torch.zeros_like(lse)).sum(0)  # [hq]
    return (-torch.exp(sink.to(adt) - base) * w).to(sink.dtype)
