"""Thin wrappers over torch.distributed used by dispatch/undispatch (token gathers along dim 0)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import CommError

# torch 2.13 renames the tensor form of all_gather; 2.11 only has all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_tokens(
    x: torch.Tensor, group: dist.ProcessGroup, world_size: int, rows: int | None = None
) -> torch.Tensor:
    """[n, ...] on every rank -> [world_size * n, ...], rank r's rows at r*n (equal n on every rank).

    `rows`: ranks hold different token counts (uneven shards): each rank's `[n_r, ...]` is padded with zeros
    to `rows` (the largest n_r) before the gather, so rank r's rows sit at `r * rows`."""
    if rows is not None and x.shape[0] < rows:
        x = torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))], dim=0)
    x = x.contiguous()
    out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
    try:
        _all_gather_single(out, x, group=group)
    except RuntimeError as exc:
        rank = dist.get_rank(group)
        raise CommError(
            f"rank {rank} of a cp group of {world_size} ranks: the all-gather of {x.shape[0]} tokens per rank "
            f"(undispatch / the backward of dispatch / roll) failed: {exc}\n(a peer rank failed, stopped or "
            "never reached this call; the wait is bounded by the process group's timeout)"
        ) from exc
    return out
