"""FA4's varlen forward and backward over the groups of a :class:`~magi_ffa_fa4.varlen.VarlenPlan`.

The result has the layouts of the block-sparse path: out ``[total_q, hq, d]`` in q's dtype, lse fp32
``[hq, total_q]`` (rows of no entry: out 0, lse -inf); gradients in q's dtype, 0 outside every entry.
"""

from __future__ import annotations

import torch

from magi_ffa import merge_out_lse_

from .varlen import VarlenPlan


def forward_varlen(fa, q, k, v, plan: VarlenPlan, scale: float, softcap: float):
    """Run every group; groups with disjoint query rows write one output (no merge), others merge."""
    tq, hq = q.shape[:2]
    if plan.q_disjoint:
        # every group writes only its entries' rows: one buffer, pre-filled only where no entry writes
        out = torch.empty_like(q) if plan.q_covered else torch.zeros_like(q)
        lse = torch.empty(hq, tq, dtype=torch.float32, device=q.device)
        if not plan.q_covered:
            lse.fill_(float("-inf"))
        for g in plan.groups:
            fa._flash_attn_fwd(
                q,
                k,
                v,
                softmax_scale=scale,
                softcap=softcap,
                return_lse=True,
                out=out,
                lse=lse,
                **g.fa4_kwargs(),
            )
        return out, lse
    # query rows shared between groups: one partial result per group, merged (more than two in fp32)
    acc_dtype = q.dtype if len(plan.groups) <= 2 else torch.float32
    out = lse = None
    for g in plan.groups:
        part_lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
        part, _ = fa._flash_attn_fwd(
            q, k, v, softmax_scale=scale, softcap=softcap, return_lse=True, lse=part_lse, **g.fa4_kwargs()
        )[:2]
        if out is None:
            out, lse = part.to(acc_dtype), part_lse
            continue
        merge_out_lse_(out, lse.t(), part, part_lse.t())
    if not plan.q_covered:  # rows of no entry: the first group left them unwritten
        out.masked_fill_(torch.isneginf(lse).t()[..., None], 0.0)
    return out.to(q.dtype), lse


def backward_varlen(
    fa, do, q, k, v, out, lse, plan: VarlenPlan, scale: float, softcap: float, deterministic, dlse
):
    """dq, dk, dv (q's dtype) of every group from the FINAL out / lse ``[total_q, hq]``; summed over groups."""
    lse_h = lse.t().contiguous()
    dlse_h = None if dlse is None else dlse.t().contiguous()
    total = None
    for g in plan.groups:
        bufs = {}
        if not g.covers_q:
            bufs["dq"] = torch.zeros_like(q)
        if not g.covers_k:
            bufs["dk"], bufs["dv"] = torch.zeros_like(k), torch.zeros_like(v)
        grads = fa._flash_attn_bwd(
            q, k, v, out, do, lse_h, softmax_scale=scale, softcap=softcap, deterministic=bool(deterministic),
            dlse=dlse_h, **bufs, **g.fa4_kwargs(),
        )[:3]  # fmt: skip
        if total is None:
            total = list(grads) if len(plan.groups) == 1 else [x.float() for x in grads]
        else:
            for acc, x in zip(total, grads):
                acc.add_(x)
    return tuple(x.to(q.dtype) for x in total)
