"""`roll`: a cyclic shift along the global sequence of a dispatched tensor, without gathering it.

`roll(local_x, shift, dim, key)` equals `dispatch(torch.roll(undispatch(local_x, key), shift, dim), key)`
(next-token labels, multi-token prediction), but each rank only sends the rows other ranks need and
receives its own: one all-to-all of O(local) rows. The routing tables depend only on the key's dispatch and
the shift, so every rank computes all of them identically (no negotiation) and they are cached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ._layout import DispatchLayout
from ._lru import remember
from ._runtime.cache import RUNTIME_CACHE
from ._runtime.checks import agree_on_call, check_key, comm_step, tensor_values
from .key import DistAttnRuntimeKey

_TABLE_CACHE_SIZE = 64


@dataclass(frozen=True, slots=True)
class RollRoute:
    """One rank's part of a shift: which local rows go to which rank, and where received rows land."""

    send_rows: np.ndarray
    """int64: local rows to send, grouped by destination rank (ascending)."""
    send_counts: list[int]
    recv_rows: np.ndarray
    """int64: local rows the received rows are written to, grouped by source rank (ascending)."""
    recv_counts: list[int]


def roll_route(layout: DispatchLayout, shift: int, rank: int) -> RollRoute:
    """Routing of `torch.roll(global, shift)` for `rank`: output token g takes input token (g - shift) mod
    total. Padding rows (global ids past the sequence) receive nothing (they stay 0). Ranks may hold
    different token counts (uneven shards): positions map to ranks through the shard offsets."""
    total, cp = layout.total_seqlen, layout.cp_size
    offsets = np.asarray(layout.shard_offsets, dtype=np.int64)
    perm = layout.permutation  # dispatched position -> global id
    where = np.empty_like(perm)
    where[perm] = np.arange(perm.shape[0])  # global id -> dispatched position
    dst_pos = np.nonzero(perm < total)[0]
    src_pos = where[(perm[dst_pos] - shift) % total]
    dst_rank = np.searchsorted(offsets, dst_pos, side="right") - 1
    src_rank = np.searchsorted(offsets, src_pos, side="right") - 1
    # both sides order a (source, destination) pair's rows by destination position: they agree
    mine_out = dst_rank == rank
    order = np.lexsort((dst_pos[mine_out], src_rank[mine_out]))
    recv_rows = (dst_pos[mine_out] - offsets[rank])[order]
    recv_counts = np.bincount(src_rank[mine_out], minlength=cp).tolist()
    mine_in = src_rank == rank
    order = np.lexsort((dst_pos[mine_in], dst_rank[mine_in]))
    send_rows = (src_pos[mine_in] - offsets[rank])[order]
    send_counts = np.bincount(dst_rank[mine_in], minlength=cp).tolist()
    return RollRoute(send_rows, send_counts, recv_rows, recv_counts)


_ROUTES: OrderedDict[tuple, tuple[RollRoute, dict]] = OrderedDict()


def _route(key: DistAttnRuntimeKey, shift: int) -> tuple[RollRoute, dict]:
    runtime = RUNTIME_CACHE.get(key)
    cache_key = (key.root_key, shift % runtime.layout.total_seqlen)
    hit = _ROUTES.get(cache_key)
    if hit is None:
        hit = (roll_route(runtime.layout, cache_key[1], runtime.rank), {})
    return remember(_ROUTES, cache_key, hit, _TABLE_CACHE_SIZE)


def _device_rows(route: RollRoute, cache: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = cache.get(device)
    if rows is None:
        rows = (torch.from_numpy(route.send_rows).to(device), torch.from_numpy(route.recv_rows).to(device))
        cache[device] = rows
    return rows


def _shift_rows(x: torch.Tensor, key: DistAttnRuntimeKey, shift: int) -> torch.Tensor:
    """Shift along dim 0 of a dispatched tensor."""
    route, cache = _route(key, shift)
    send_rows, recv_rows = _device_rows(route, cache, x.device)
    send = x.index_select(0, send_rows)
    recv = x.new_empty((int(recv_rows.shape[0]), *x.shape[1:]))
    with comm_step(key.cp_group, f"all-to-all of roll (shift {shift})"):
        dist.all_to_all_single(recv, send, route.recv_counts, route.send_counts, group=key.cp_group.group)
    out = torch.zeros_like(x)
    out.index_copy_(0, recv_rows, recv)
    return out


class _RollFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, key: DistAttnRuntimeKey, shift: int) -> torch.Tensor:
        ctx.key, ctx.shift = key, shift
        return _shift_rows(x, key, shift)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank runs this backward: a rank that skipped it is named instead of awaited
        agree_on_call(
            ctx.key.cp_group, "roll (backward)", lambda: None, same=lambda: tensor_values(grad, "grad")
        )
        # a roll is a permutation of the real tokens: its adjoint is the opposite roll
        return _shift_rows(grad.contiguous(), ctx.key, -ctx.shift), None, None


def roll(x: torch.Tensor, shift: int, dim: int, key: DistAttnRuntimeKey) -> torch.Tensor:
    """Cyclic shift of a dispatched tensor along the global sequence.

    Args:
        x: a dispatched tensor: this rank's tokens on dimension `dim` (`key.shard_seqlen` of them), any
            other dimensions and dtype.
        shift: like `torch.roll`: global token t of the result is global token (t - shift) mod
            total_seqlen of `x`. Negative shifts roll left (`shift=-1` gives next-token targets).
        dim: the token dimension of `x`.
        key: the key `x` was dispatched with.

    Returns:
        A tensor of `x`'s shape on this rank: `dispatch(torch.roll(undispatch(x), shift, dim), key)`; padding
        rows are 0. Differentiable (the backward rolls the gradient back). Collective: every rank of the cp
        group must call it with the same shift.
    """
    runtime = RUNTIME_CACHE.get(check_key(key))

    def check() -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
        if isinstance(shift, bool) or not isinstance(shift, int):
            raise TypeError(f"`shift` must be an int, got {type(shift).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
            raise ValueError(f"`dim` must be an int in [{-x.ndim}, {x.ndim}) for x of shape {tuple(x.shape)}")
        if x.shape[dim] != runtime.local_seqlen:
            raise ValueError(
                f"`x` has {x.shape[dim]} tokens on dim {dim}, this rank's shard of the key has "
                f"{runtime.local_seqlen}: pass a dispatched tensor"
            )

    agree_on_call(
        key.cp_group,
        "roll",
        check,
        # the token dim first: with uneven shards only its length differs between ranks
        same=lambda: {"shift": shift, "dim": dim % x.ndim, **tensor_values(x.movedim(dim, 0), "x")},
    )
    if key.cp_size == 1:
        return torch.roll(x, shift, dim)
    moved = x.movedim(dim, 0).contiguous()
    return _RollFunction.apply(moved, key, shift).movedim(0, dim)
