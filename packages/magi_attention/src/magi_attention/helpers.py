"""Small helpers MagiAttention users call around the keys: padding arithmetic and batch <-> packed layouts."""

from __future__ import annotations

import math

import torch


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def compute_pad_size(total_seqlen: int, cp_size: int, chunk_size: int) -> int:
    """Tokens appended so that the sequence splits into whole chunks, the same number per rank.

    Args:
        total_seqlen: tokens of the (packed) sequence.
        cp_size: ranks of the context-parallel group.
        chunk_size: tokens per dispatch chunk.

    Returns:
        `ceil(total_seqlen / (chunk_size * cp_size)) * chunk_size * cp_size - total_seqlen` (>= 0).
    """
    total = _positive(total_seqlen, "total_seqlen")
    unit = _positive(chunk_size, "chunk_size") * _positive(cp_size, "cp_size")
    return math.ceil(total / unit) * unit - total


def squash_batch_dim(x: torch.Tensor) -> torch.Tensor:
    """`[batch, seqlen, ...]` -> `[batch * seqlen, ...]` (a view when possible): a batch as one packed sequence.

    Args:
        x: a tensor with at least two dimensions (batch first, then tokens).
    """
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        raise ValueError(
            f"`x` must be a tensor of at least 2 dims [batch, seqlen, ...], got {getattr(x, 'shape', x)}"
        )
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def infer_varlen_mask_from_batch(
    batch_size: int, seqlen: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cu_seqlens` of a batch packed by `squash_batch_dim`: each sample is one document.

    Args:
        batch_size: samples in the batch.
        seqlen: tokens per sample.
        device: where the returned tensors live.

    Returns:
        `(cu_seqlens_q, cu_seqlens_k)`, int32 `[batch_size + 1]`: `0, seqlen, 2 * seqlen, ...` (equal tensors).
    """
    b, s = _positive(batch_size, "batch_size"), _positive(seqlen, "seqlen")
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
    return cu, cu.clone()
