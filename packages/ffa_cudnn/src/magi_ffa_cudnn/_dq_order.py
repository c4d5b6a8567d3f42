"""The order in which cuDNN's deterministic backward adds each query block's dQ (sm90), chosen for speed.

cuDNN's deterministic sm90 backward (nvidia-cudnn-frontend 1.32.0) gives every key block one CTA, launched in
descending key-block order, and makes the CTAs that touch a query block add their partial dQ to it in a fixed
order: a semaphore per (head, query block) and, per (key block, query block) pair of the plan, its place in
that order (``dq_write_order`` / ``dq_write_order_full``, parallel to the plan's partial and full block
lists). cuDNN's plan fills in descending key-block order. Each CTA visits its partial query blocks first and
its full ones after, so on a band (sliding window) or on fragmented masks a CTA's first (partial) block
waits for the next key block's last (full) ones: the waits chain along the band and the CTAs of a head run
one after another (23-33x the default backward at 32k, measured on the H200).

The order is only data: any permutation of each query block's writers is a deterministic sum. Here writers
are ordered by (launch group, place in the writer's own visiting order, launch rank): inside a group of
``group`` consecutively launched key blocks of a head, whichever writer reaches a query block earlier in its
own sequence adds first, so no CTA waits for another's later work; across groups the earlier-launched group
adds first. A CTA therefore waits only for CTAs of its own group or of earlier-launched groups, and a group
spans at most ``RESIDENT_CTAS`` consecutive launches (the L2 head swizzle interleaves heads, counted in), so
whenever the lowest unfinished CTA's group is stalled all its CTAs are resident: no deadlock as long as that
many of the backward's CTAs fit on the GPU at once (one per SM on sm90; 132 SMs on an H100 / H200, so other
kernels may hold half of them). ``group == 1`` is cuDNN's own order.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["RESIDENT_CTAS", "dq_write_ranks", "head_swizzle", "reorder_deterministic_dq"]

RESIDENT_CTAS = 64
"""The most consecutively launched backward CTAs one write-order group spans (see the module docstring)."""

_L2_BYTES = 40 * 1024 * 1024  # the L2 size cuDNN's backward tile scheduler assumes for its head swizzle


def head_swizzle(seqlen_q: int, head_dim: int, head_dim_v: int, element_size: int) -> int:
    """How many heads cuDNN's deterministic sm90 backward interleaves block by block (its L2 swizzle).

    Mirrors ``SingleTileLPTBwdScheduler.Params.create``: the largest power of two of heads whose q, dO and
    fp32 dQ accumulator fit in 40 MiB, at least 1.
    """
    per_head = seqlen_q * (head_dim + head_dim_v) * element_size + seqlen_q * head_dim * 4
    if per_head <= 0 or per_head > _L2_BYTES:
        return 1
    return 1 << int(math.log2(_L2_BYTES // per_head))


def _entries(count: torch.Tensor, offset: torch.Tensor, index: torch.Tensor):
    """For every slot of a compact block list: its row, place in the row, query block (int64) and whether
    a row uses it (bool), computed without reading anything back to the host.

    ``count``: int32 ``[hmask, n_blocks]``, the row's entries; ``offset``: int32 ``[hmask * n_blocks + 1]``,
    where each row starts in ``index``; ``index``: int32 query-block indices."""
    cnt = count.reshape(-1).long()
    starts = offset.long()[:-1]
    slot = torch.arange(index.numel(), device=index.device)
    row = (torch.searchsorted(starts, slot, right=True) - 1).clamp_(0, max(cnt.numel() - 1, 0))
    place = slot - starts[row]
    used = (place >= 0) & (place < cnt[row])
    return row, place, index.long(), used


_UNUSED = 1 << 62  # the sort key of slots no row uses: after every (mask head, query block)


def dq_write_ranks(
    partial_count: torch.Tensor,
    partial_offset: torch.Tensor,
    partial_index: torch.Tensor,
    full_count: torch.Tensor,
    full_offset: torch.Tensor,
    full_index: torch.Tensor,
    *,
    group: int,
    launch_descending: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (key block, query block) pair's place among the writers of that query block's dQ.

    The lists are a backward plan's compact key-to-query block lists (row ``h * n_blocks + n`` holds key
    block ``n``'s partial, then full, query blocks, each ascending; the kernel visits them in that order).
    Returns int32 ranks parallel to ``partial_index`` and ``full_index`` (slots no row uses get 0): for
    each (mask head, query block), its writers numbered 0, 1, ... by (launch group, place in the writer's
    visiting order, launch rank), where the launch rank of key block ``n`` is ``n_blocks - 1 - n`` when
    CTAs launch in descending key-block order and ``n`` otherwise, and its group is ``launch rank // group``.
    A pure function of the lists, run on their device with no read back to the host (it runs when a new
    mask's first deterministic backward starts, behind the kernels already queued).
    """
    if group < 1:
        raise ValueError(f"`group` must be at least 1, got {group!r}")
    n_blocks = partial_count.shape[-1]
    prow, pplace, pm, pused = _entries(partial_count, partial_offset, partial_index)
    frow, fplace, fm, fused = _entries(full_count, full_offset, full_index)
    fplace = fplace + partial_count.reshape(-1).long()[frow]  # full blocks come after the row's partial ones
    row, place = torch.cat([prow, frow]), torch.cat([pplace, fplace])
    m, used = torch.cat([pm, fm]), torch.cat([pused, fused])
    if m.numel() == 0:
        return torch.zeros_like(partial_index), torch.zeros_like(full_index)
    head, n = row // n_blocks, row % n_blocks
    launch = n_blocks - 1 - n if launch_descending else n
    places = m.numel() + 1  # more than any row's length: no read of the longest row needed
    within = (
        (launch // group) * places + place.clamp(min=0)
    ) * n_blocks + launch  # order among a block's writers
    by_block = torch.where(used, head * (1 << 31) + m, _UNUSED)  # query blocks are int32
    order = torch.sort(within, stable=True).indices
    order = order[torch.sort(by_block[order], stable=True).indices]
    sorted_block = by_block[order]
    pos = torch.arange(order.numel(), device=m.device)
    starts = torch.ones_like(sorted_block, dtype=torch.bool)
    starts[1:] = sorted_block[1:] != sorted_block[:-1]
    first = torch.cummax(torch.where(starts, pos, torch.zeros_like(pos)), 0).values
    ranks = torch.empty_like(pos)
    ranks[order] = pos - first
    ranks = torch.where(used, ranks, 0).to(torch.int32)
    return ranks[: partial_index.numel()], ranks[partial_index.numel() :]


def reorder_deterministic_dq(mask_plan: Any, resident_ctas: int = RESIDENT_CTAS) -> bool:
    """Rewrite a cuDNN mask plan's dQ write order in place (see the module docstring); True if it did.

    Only sm90 fixed-length plans with a backward are rewritten (sm100's deterministic backward and varlen
    plans keep cuDNN's order). The tensors are overwritten, not replaced: cuDNN's plan checks that its
    topology and its block-sparse tensors are the same objects. Pinned to nvidia-cudnn-frontend 1.32.0's
    plan layout (private attributes, as ``magi_ffa_cudnn._launch`` is).
    """
    md = mask_plan.metadata
    bwd = getattr(getattr(mask_plan, "_packed_plan", None), "bwd_tensors", None)
    if md.arch != 90 or bwd is None or bwd.cu_total_m_blocks is not None or bwd.dq_write_order is None:
        return False
    element_size = torch.empty((), dtype=md.dtype).element_size()
    swizzle = head_swizzle(md.total_q // md.batch_size, md.head_dim, md.head_dim_v, element_size)
    ranks_p, ranks_f = dq_write_ranks(
        bwd.mask_block_cnt, bwd.mask_block_offset, bwd.mask_block_idx,
        bwd.full_block_cnt, bwd.full_block_offset, bwd.full_block_idx,
        group=max(1, resident_ctas // swizzle), launch_descending=bool(bwd.spt),
    )  # fmt: skip
    bwd.dq_write_order.copy_(ranks_p)
    bwd.dq_write_order_full.copy_(ranks_f)
    return True
