"""A torchtitan batch of packed documents -> one magi key and this cp rank's tokens, labels and positions.

torchtitan's dataloaders yield `({"input": [B, L], "positions": [B, L]}, labels [B, L])`: labels are already the
next token inside each document (-100 where there is none), and `positions` restart at 0 where a document
starts. The B rows are packed into one sequence of B * L tokens (no document crosses a row), planned once with
`magi_attn_varlen_key` (causal inside each document) and dispatched over the cp group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from magi_attention.api import dispatch, magi_attn_varlen_key
from magi_attention.config import DistAttnConfig

from .attention import MagiAttentionMask

__all__ = ["IGNORE_INDEX", "MagiBatch", "RopePositions", "dispatch_batch", "document_cu_seqlens"]

IGNORE_INDEX = -100
"""Label of tokens without a target (torchtitan's and PyTorch's cross-entropy ignore index)."""

RopePositions = Literal["document", "global"]
"""RoPE positions: "document" (the dataloader's positions, restarting at each document) or "global" (the
token's index in its row of the batch)."""


@dataclass(frozen=True, slots=True)
class MagiBatch:
    """This cp rank's share of one packed batch, in the shapes torchtitan's models take (batch dim 1)."""

    input_ids: torch.Tensor
    """`[1, T]` int64, this rank's tokens (T = the key's shard length; padding rows hold token 0)."""
    labels: torch.Tensor
    """`[1, T]` int64, their targets; `IGNORE_INDEX` at padding and where the dataloader had none."""
    positions: torch.Tensor
    """`[1, T]` int64 RoPE positions (see `RopePositions`); 0 at padding."""
    attention_masks: MagiAttentionMask
    """The batch's magi key: the model's `attention_masks` argument."""
    cu_seqlens: tuple[int, ...]
    """Document boundaries in the packed sequence of B * L tokens: `(0, ..., B * L)`."""


def document_cu_seqlens(positions: torch.Tensor | None, batch: int, seq_len: int) -> tuple[int, ...]:
    """Boundaries of the documents of a `[batch, seq_len]` batch packed row after row.

    Args:
        positions: `[batch, seq_len]` integer positions, 0 where a document starts; None: one document per row.
        batch, seq_len: the batch shape.

    Returns:
        `(0, ..., batch * seq_len)`: a document starts at every row start and wherever `positions` is 0.
    """
    starts = torch.zeros(batch, seq_len, dtype=torch.bool)
    starts[:, 0] = True
    if positions is not None:
        starts |= positions.detach().cpu() == 0
    return (*starts.flatten().nonzero().flatten().tolist(), batch * seq_len)


def _check_batch(inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None) -> None:
    if inputs.ndim != 2 or inputs.numel() == 0 or inputs.is_floating_point():
        raise ValueError(
            f"inputs must be integer token ids [batch, seq_len], got {inputs.dtype} {tuple(inputs.shape)}"
        )
    if labels.shape != inputs.shape:
        raise ValueError(
            f"labels must have the shape of inputs {tuple(inputs.shape)}, got {tuple(labels.shape)}"
        )
    if positions is not None and positions.shape != inputs.shape:
        raise ValueError(
            f"positions must have the shape of inputs {tuple(inputs.shape)}, got {tuple(positions.shape)}"
        )


def dispatch_batch(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    positions: torch.Tensor | None,
    cp_mesh: Any,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    rope_positions: RopePositions = "document",
    dist_attn_config: DistAttnConfig | None = None,
) -> MagiBatch:
    """Plan causal per-document attention for a packed batch and keep this cp rank's share of it.

    Every rank of the cp group must pass the same batch (torchtitan's dataloader gives the cp ranks of one
    data-parallel replica the same batch).

    Args:
        inputs: `[B, L]` int64 token ids.
        labels: `[B, L]` int64 next-token targets, `IGNORE_INDEX` where none.
        positions: `[B, L]` int64 positions, 0 at each document start; None: each row is one document.
        cp_mesh: the context-parallel group: a 1-D DeviceMesh or a ProcessGroup.
        num_heads_q, num_heads_kv, head_dim: the model's attention shapes.
        rope_positions: "document" or "global" (see `RopePositions`).
        dist_attn_config: magi-attention settings (`DistAttnConfig()` if None).

    Returns:
        A `MagiBatch`; its tensors are on the device of `inputs`.
    """
    _check_batch(inputs, labels, positions)
    if rope_positions not in ("document", "global"):
        raise ValueError(f"rope_positions must be 'document' or 'global', got {rope_positions!r}")
    batch, seq_len = inputs.shape
    cu_seqlens = document_cu_seqlens(positions, batch, seq_len)
    key = magi_attn_varlen_key(
        list(cu_seqlens),
        list(cu_seqlens),
        num_heads_q,
        num_heads_kv,
        head_dim,
        cp_mesh,
        causal=True,
        dist_attn_config=dist_attn_config,
    )
    if rope_positions == "global" or positions is None:  # without positions, each row is one document
        rope = torch.arange(seq_len, device=inputs.device).expand(batch, seq_len)
    else:
        rope = positions
    return MagiBatch(
        input_ids=dispatch(inputs.flatten(), key, pad_value=0).unsqueeze(0),
        labels=dispatch(labels.flatten(), key, pad_value=IGNORE_INDEX).unsqueeze(0),
        positions=dispatch(rope.flatten().to(torch.long), key, pad_value=0).unsqueeze(0),
        attention_masks=MagiAttentionMask(key),
        cu_seqlens=cu_seqlens,
    )
