"""Run every rank's share of a plan in one process, with no communication.

Used to check the distributed decomposition with the real kernels on one device (GPU bf16 or CPU fp64)
and to time each rank's compute for simulated context parallelism. GroupCast is simulated by indexing
the global K/V with each stage's `remote_k_ranges`; GroupReduce by `index_add_` into the global dK/dV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from magi_ffa.validation import acc_dtype
from magi_solver import AttnRanges, DistAttnPlan, RankPlan, SliceList

from ._runtime.cache import KernelSlices
from ._runtime.kernels import AttnKernel, attn_kernel
from .config import KernelBackend

__all__ = [
    "RankCalls",
    "auto_launchers",
    "call_slices",
    "checked_slices",
    "kernel_launchers",
    "kernel_ranges",
    "rank_calls",
    "simulate_dist_attn",
    "token_index",
]


def token_index(ranges: AttnRanges, device: torch.device) -> torch.Tensor:
    """int64 indices of the tokens of `ranges`, in order."""
    parts = [torch.arange(r.start, r.end, device=device) for r in ranges]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)


def kernel_ranges(slices: SliceList) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 host tensors (FFA keeps its own device copy; host ranges avoid a sync per call)."""
    n = len(slices.types)
    return (
        torch.tensor(slices.q_ranges, dtype=torch.int32).reshape(n, 2),
        torch.tensor(slices.k_ranges, dtype=torch.int32).reshape(n, 2),
        torch.tensor(slices.types, dtype=torch.int32).reshape(n),
    )


def kernel_launchers(backend: KernelBackend | str, backward: KernelBackend | str | None = None) -> AttnKernel:
    """The launchers `calc_attn` runs for kernel backend `backend` (any registered name; the backward on
    `backward` when given): `fwd` / `bwd` take range tables (checked every call), `fwd_slices` /
    `bwd_slices` take `checked_slices` (checked once, as the runtime's calls). Raises ValueError for an
    unknown name."""
    return attn_kernel(str(backend), None if backward is None else str(backward))


def checked_slices(q_ranges: torch.Tensor, k_ranges: torch.Tensor, types: torch.Tensor) -> KernelSlices:
    """One kernel call's slices (`[n, 2]`, `[n, 2]` and `[n]` int32 host tensors) as the runtime hands them to
    the launchers' `fwd_slices` / `bwd_slices`: checked on first use, never again."""
    return KernelSlices(q_ranges, k_ranges, types, int(types.shape[0]))


def auto_launchers(
    q_ranges: list, k_ranges: list, types: list, rows: list, kv_layout: object, head_dim: int
) -> tuple[AttnKernel, str]:
    """The launchers `kernel_backend="auto"` picks on this GPU for a plan of the global mask (`[start, end)`
    range lists, int type codes), by the runtime's rule with every backend this process can run as a
    candidate (the backward's backend may differ), and the reason. `rows`: each rank's global query ids
    (`plan.dispatch.position_ids(rank)`); `kv_layout`: the plan's (None: keys dispatched as the queries)."""
    from magi_solver.kernel_choice import RankProblems

    from ._runtime.kernels import choose_auto, probe_local, resolve

    problems = RankProblems(q_ranges, k_ranges, types, rows, kv_layout)  # as the runtime asks the table
    choice = choose_auto(resolve("auto", head_dim, [probe_local()]), head_dim, problems)
    return attn_kernel(choice.backend, choice.backward), choice.reason


@dataclass
class RankCalls:
    """One rank's kernel calls as the runtime makes them: `calls` holds (range tensors, K, V) of each call and
    `key_index` the global ids of each call's keys (where its dK / dV go). Merged (overlap degree 0): one
    call over the rank's keys followed by every stage's; else the host call, then one per remote stage."""

    local_index: torch.Tensor
    remote_index: list[torch.Tensor]
    calls: list[tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]]
    key_index: list[torch.Tensor]


def call_slices(rank_plan: RankPlan, *, merged: bool) -> list[SliceList]:
    """The slices of each kernel call `dist_attn` makes on this rank: with `merged` (overlap degree 0) one
    call on `merged_slices`, whose keys are the rank's own followed by every stage's received ones; else the
    host call on the rank's own keys, then one call per remote stage on that stage's received keys."""
    if merged:
        return [rank_plan.merged_slices]
    return [rank_plan.host_slices, *(s.remote_slices for s in rank_plan.stages)]


def rank_calls(
    rank_plan: RankPlan,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_ranges: AttnRanges | None = None,
    *,
    merged: bool = False,
) -> RankCalls:
    """`kv_ranges`: the rank's own key ranges when they differ from its query ranges (cross-attention);
    `merged`: the plan's overlap degree is 0 (`DistAttnPlan.overlap_degree`), as `dist_attn` then runs."""
    dev = k.device
    local = token_index(rank_plan.host_token_ranges if kv_ranges is None else kv_ranges, dev)
    remote = [token_index(s.remote_k_ranges, dev) for s in rank_plan.stages]
    keys = [torch.cat([local, *remote])] if merged else [local, *remote]
    slices = call_slices(rank_plan, merged=merged)
    calls = [(kernel_ranges(sl), k[idx], v[idx]) for sl, idx in zip(slices, keys, strict=True)]
    return RankCalls(local, remote, calls, keys)


def simulate_dist_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    plan: DistAttnPlan,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    *,
    kernel_backend: KernelBackend | str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Forward and backward of `plan`, rank by rank, each rank's kernel calls as the runtime makes them
    (`rank_calls`: one merged call at overlap degree 0).

    Args:
        q, do: `[padded_total, heads_q, d]` global tensors; k, v: `[padded_total_k, heads_kv, d]` (the
            padded key sequence: the same as q's in self-attention).
        plan: from `magi_solver.plan_attention` (the runtime's planning path) for the same padded length.
        softmax_scale, softcap: as in `calc_attn`.
        kernel_backend: "fa4", "triton" or "torch" (a `KernelBackend`); None = triton for CUDA fp16/bf16,
            torch otherwise.

    Returns:
        `(out, lse, dq, dk, dv)` in global token order; out/dq/dk/dv in q's dtype, lse fp32 (fp64 for fp64).
    """
    acc = acc_dtype(q.dtype)
    out_g = torch.full_like(q, float("nan"))
    lse_g = torch.full(q.shape[:2], float("nan"), dtype=acc, device=q.device)
    dq_g = torch.full(q.shape, float("nan"), dtype=acc, device=q.device)
    dk_g = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_g = torch.zeros(v.shape, dtype=acc, device=v.device)
    kw = {"softmax_scale": softmax_scale, "softcap": softcap}
    if kernel_backend is None or KernelBackend(kernel_backend) == KernelBackend.AUTO:
        low_precision = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        kernel_backend = KernelBackend.TRITON if low_precision else KernelBackend.TORCH
    kernel = attn_kernel(KernelBackend(kernel_backend))
    ffa_fwd, ffa_bwd = kernel.fwd, kernel.bwd
    kv = plan.kv_layout
    for rank_plan in plan.ranks:
        rc = rank_calls(
            rank_plan, k, v, None if kv is None else kv.host_token_ranges(rank_plan.rank),
            merged=plan.overlap_degree == 0,
        )  # fmt: skip
        q_index = token_index(rank_plan.host_token_ranges, q.device)
        lq, ldo = q[q_index], do[q_index]
        out = torch.zeros(lq.shape, dtype=acc, device=q.device)
        lse = torch.full(lq.shape[:2], float("-inf"), dtype=acc, device=q.device)
        for (qr, kr, tr), kk, vv in rc.calls:
            if qr.shape[0]:
                ffa_fwd(lq, kk, vv, qr, kr, tr, out=out, lse=lse, **kw)
        out_q = out.to(q.dtype)
        dq = torch.zeros(lq.shape, dtype=acc, device=q.device)
        for ((qr, kr, tr), kk, vv), index in zip(rc.calls, rc.key_index, strict=True):
            dk = torch.zeros(kk.shape, dtype=acc, device=k.device)
            dv = torch.zeros(vv.shape, dtype=acc, device=v.device)
            if qr.shape[0]:
                ffa_bwd(ldo, lq, kk, vv, out_q, lse, qr, kr, tr, dq=dq, dk=dk, dv=dv, **kw)
            dk_g.index_add_(0, index, dk)
            dv_g.index_add_(0, index, dv)
        out_g[q_index] = out_q
        lse_g[q_index] = lse
        dq_g[q_index] = dq
    return out_g, lse_g, dq_g.to(q.dtype), dk_g.to(k.dtype), dv_g.to(v.dtype)
