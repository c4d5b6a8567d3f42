"""A torchtitan batch of packed documents -> one magi key and this cp rank's tokens, labels and positions.

torchtitan's dataloaders yield `({"input": [B, L], "positions": [B, L]}, labels [B, L])`: labels are already the
next token inside each document (-100 where there is none), and `positions` restart at 0 where a document
starts. The B rows are packed into one sequence of B * L tokens (no document crosses a row), planned once with
`magi_attn_varlen_key` (causal inside each document) and dispatched over the cp group.

The key's dispatch solve (which tokens each rank owns) is a pure function of the documents, the cp size and the
config, so it can run ahead, in the dataloader's worker processes: `plan_in_dataloader` makes a dataloader's
batches carry it (`plan_batch_ahead`, under `MAGI_PREPARED` in the input dict) and `dispatch_batch(...,
prepared=...)` adopts it, so the training process builds the key without solving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, default_collate

from magi_attention.api import (
    PreparedDispatch,
    adopt_dispatch,
    dispatch,
    magi_attn_varlen_key,
    prepare_varlen_dispatch,
)
from magi_attention.config import DistAttnConfig

from .attention import MagiAttentionMask

__all__ = [
    "IGNORE_INDEX",
    "MAGI_PREPARED",
    "MagiBatch",
    "PlanAheadCollate",
    "RopePositions",
    "dispatch_batch",
    "document_cu_seqlens",
    "plan_batch_ahead",
    "plan_in_dataloader",
]

IGNORE_INDEX = -100
"""Label of tokens without a target (torchtitan's and PyTorch's cross-entropy ignore index)."""

MAGI_PREPARED = "magi_prepared"
"""Input-dict key of a batch's dispatch solved ahead (a `PreparedDispatch`; see `plan_in_dataloader`)."""

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


def plan_batch_ahead(
    positions: torch.Tensor | None,
    batch: int,
    seq_len: int,
    *,
    cp_size: int,
    dist_attn_config: DistAttnConfig | None = None,
) -> PreparedDispatch:
    """Solve, without a process group, the dispatch that `dispatch_batch` of this batch will need over `cp_size`
    ranks: the request of its key exactly (the documents of `document_cu_seqlens`, causal, this config).

    Run it where its time is hidden (a dataloader worker: `plan_in_dataloader`) and pass the result to
    `dispatch_batch(..., prepared=...)`; the key then takes it instead of solving. A pure function of its
    arguments.

    Args:
        positions: `[batch, seq_len]` integer positions, 0 where a document starts; None: one document per row.
        batch, seq_len: the batch shape.
        cp_size: ranks of the cp group `dispatch_batch` will run on.
        dist_attn_config: the config `dispatch_batch` will get (`DistAttnConfig()` if None; only its dispatch
            settings matter here).

    Returns:
        A picklable `PreparedDispatch` for the batch's `batch * seq_len` packed tokens.
    """
    cu_seqlens = list(document_cu_seqlens(positions, batch, seq_len))
    return prepare_varlen_dispatch(
        cu_seqlens, cu_seqlens, cp_size, causal=True, dist_attn_config=dist_attn_config
    )


class PlanAheadCollate:
    """A dataloader's `collate_fn` that also solves each batch's dispatch (`plan_batch_ahead`), in the worker
    process that collates it, and adds it to the batch's input dict under `MAGI_PREPARED`.

    Args:
        collate_fn: the collate function to wrap; it must return `(input_dict, labels)` with `input_dict["input"]`
            `[B, L]` and, optionally, `input_dict["positions"]` `[B, L]` (torchtitan's text dataloaders).
        cp_size, dist_attn_config: as `plan_batch_ahead`: the cp size and config the training loop's
            `dispatch_batch` uses.
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        *,
        cp_size: int,
        dist_attn_config: DistAttnConfig | None = None,
    ) -> None:
        self.collate_fn = collate_fn
        self.cp_size = cp_size
        self.dist_attn_config = dist_attn_config

    def __call__(self, samples: list[Any]) -> tuple[dict[str, Any], torch.Tensor]:
        input_dict, labels = self.collate_fn(samples)
        if not isinstance(input_dict, dict) or "input" not in input_dict:
            raise TypeError(
                f"PlanAheadCollate needs batches ({{'input': [B, L], ...}}, labels), got a "
                f"{type(input_dict).__name__} first"
            )
        inputs = input_dict["input"]
        if inputs.ndim != 2:
            raise ValueError(f"input must be [batch, seq_len], got {tuple(inputs.shape)}")
        input_dict[MAGI_PREPARED] = plan_batch_ahead(
            input_dict.get("positions"),
            *inputs.shape,
            cp_size=self.cp_size,
            dist_attn_config=self.dist_attn_config,
        )
        return input_dict, labels


def plan_in_dataloader(
    dataloader: DataLoader, *, cp_size: int, dist_attn_config: DistAttnConfig | None = None
) -> None:
    """Make a dataloader's worker processes solve each batch's dispatch: its `collate_fn` becomes a
    `PlanAheadCollate` around the one it has, so its batches carry a `PreparedDispatch` under `MAGI_PREPARED`
    (which `prepare_magi_input` passes to `dispatch_batch`). Call it before iterating the dataloader.

    Args:
        dataloader: a torch `DataLoader` (torchtitan's `ParallelAwareDataloader` is one) with `num_workers >= 1`.
        cp_size, dist_attn_config: as `plan_batch_ahead`.

    Raises:
        TypeError: `dataloader` is not a torch `DataLoader`.
        ValueError: it has no worker process (the solve would stay in the training process).
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"plan_in_dataloader needs a torch DataLoader (a collate_fn run in worker processes), got "
            f"{type(dataloader).__name__}"
        )
    if dataloader.num_workers < 1:
        raise ValueError(
            "plan_in_dataloader needs a dataloader with worker processes (num_workers >= 1, "
            "--dataloader.num_workers 1 on torchtitan's command line), got num_workers=0: the solve would "
            "stay in the training process"
        )
    collate_fn = dataloader.collate_fn
    if isinstance(collate_fn, PlanAheadCollate):  # planned already: plan once, with these settings
        collate_fn = collate_fn.collate_fn
    # a DataLoader's iterators read collate_fn when they are created, so this holds from the next iterator on
    dataloader.collate_fn = PlanAheadCollate(collate_fn, cp_size=cp_size, dist_attn_config=dist_attn_config)


def _cp_size(cp_mesh: Any) -> int | None:
    """Ranks of the cp group `cp_mesh` names as magi resolves it (None: the default group, or this process
    alone); None for a type magi will reject itself."""
    if cp_mesh is None:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    size = getattr(cp_mesh, "size", None)  # DeviceMesh.size(): all its ranks; ProcessGroup.size()
    return size() if callable(size) else None


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
    prepared: PreparedDispatch | None = None,
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
        prepared: this batch's dispatch solved ahead (`plan_batch_ahead` of the same positions, cp size and
            config), adopted before the key is built so the key does not solve it; None: the key solves.
            One solved for another batch of the same size or another config is not used (the key solves
            its own placement; the result is the same).

    Returns:
        A `MagiBatch`; its tensors are on the device of `inputs`.

    Raises:
        TypeError: `prepared` is not a `PreparedDispatch`.
        ValueError: `prepared` was solved for another cp size or another number of tokens.
    """
    _check_batch(inputs, labels, positions)
    if rope_positions not in ("document", "global"):
        raise ValueError(f"rope_positions must be 'document' or 'global', got {rope_positions!r}")
    batch, seq_len = inputs.shape
    if prepared is not None:
        adopt_dispatch(prepared, cp_size=_cp_size(cp_mesh), total_seqlen=batch * seq_len)
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
