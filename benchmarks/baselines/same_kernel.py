"""Context-parallel baselines on magi-attention's own local kernel (for the cp case).
What it measures and how to run it: docs/benchmarks/cases.md (baselines/same_kernel)."""

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
from magi_mask import as_int_pairs, decompose_region, region_of, tighten_region

from magi_ffa import ffa_bwd, ffa_fwd
from magi_ffa.validation import acc_dtype
from magi_solver import SliceList
from magi_solver.mask import normalize_mask

Piece = tuple[int, int, int]
"""``(global_start, global_end, local_start)``: a run of tokens and where it sits in a local buffer."""
TypedSlice = tuple[int, int, int, int, int]


class CPBaseline(StrEnum):
    """The baseline distribution schemes (see the module docstring)."""

    ULYSSES = "ulysses"
    RING_ZIGZAG = "ring_zigzag"
    ALLGATHER_KV = "allgather_kv"


# -- planning (pure, host ints) -----------------------------------------------------------------------------
def clip_slices(slices: Sequence[TypedSlice], q_pieces: Sequence[Piece], k_pieces: Sequence[Piece]) -> SliceList:  # fmt: skip
    """Disjoint global typed slices restricted to the q pieces x the k pieces, as disjoint typed slices in
    local (q, k) coordinates (touching FULL pieces fused)."""
    out: list[TypedSlice] = []
    for s in slices:
        qs, qe, ks, ke, lo, hi = region_of(*s)
        for a, b, qloc in q_pieces:
            if b <= qs or a >= qe:
                continue
            for c, d, kloc in k_pieces:
                if d <= ks or c >= ke:
                    continue
                r = tighten_region(max(qs, a), min(qe, b), max(ks, c), min(ke, d), lo, hi)
                if r is None:
                    continue
                for x0, x1, y0, y1, t in decompose_region(r):
                    out.append((x0 - a + qloc, x1 - a + qloc, y0 - c + kloc, y1 - c + kloc, t))
    return SliceList.from_typed(_fuse_full(out))


def _fuse_full(slices: list[TypedSlice]) -> list[TypedSlice]:
    """Fuse FULL slices with equal q ranges and touching k ranges, then equal k ranges and touching q: fewer,
    longer slices are cheaper for the kernel; the union (and disjointness) is unchanged."""
    full = sorted(s[:4] for s in slices if s[4] == 0)
    fused: list[tuple[int, int, int, int]] = []
    for s in full:  # (qs, qe, ks, ke) order: same q range, ascending k
        p = fused[-1] if fused else None
        if p and p[0] == s[0] and p[1] == s[1] and p[3] == s[2]:
            fused[-1] = (p[0], p[1], p[2], s[3])
        else:
            fused.append(s)
    fused2: list[tuple[int, int, int, int]] = []
    for ks, ke, qs, qe in sorted((s[2], s[3], s[0], s[1]) for s in fused):
        p = fused2[-1] if fused2 else None
        if p and p[2] == ks and p[3] == ke and p[1] == qs:
            fused2[-1] = (p[0], qe, ks, ke)
        else:
            fused2.append((qs, qe, ks, ke))
    return sorted([(*s, 0) for s in fused2] + [s for s in slices if s[4] != 0])


def token_ranges(system: CPBaseline | str, total_seqlen: int, cp_size: int, rank: int) -> tuple[tuple[int, int], ...]:  # fmt: skip
    """Global token ranges rank ``rank`` holds, in local order: one contiguous shard (Ulysses) or the
    zigzag pair of chunks ``rank`` and ``2 cp - 1 - rank`` (ring, all-gather)."""
    if CPBaseline(system) == CPBaseline.ULYSSES:
        n = total_seqlen // cp_size
        return ((rank * n, (rank + 1) * n),)
    c = total_seqlen // (2 * cp_size)
    j = 2 * cp_size - 1 - rank
    return ((rank * c, (rank + 1) * c), (j * c, (j + 1) * c))


def _pieces(ranges: Sequence[tuple[int, int]], base: int = 0) -> list[Piece]:
    out, loc = [], base
    for a, b in ranges:
        out.append((a, b, loc))
        loc += b - a
    return out


@dataclass(frozen=True, slots=True)
class BaselinePlan:
    """What one rank computes (host ints only; identical inputs give identical plans on every rank)."""

    system: CPBaseline
    cp_size: int
    rank: int
    total_seqlen: int
    num_heads_q: int
    num_heads_kv: int
    token_ranges: tuple[tuple[int, int], ...]
    """Global token ranges of this rank's rows, in local order."""
    steps: tuple[SliceList, ...]
    """Kernel slices. ULYSSES: one step, the whole mask on the gathered sequence (this rank's heads).
    RING_ZIGZAG: ``cp`` steps, step ``j`` = local q x the K/V of rank ``(rank - j) % cp`` in that rank's
    local coordinates. ALLGATHER_KV: one step, local q x the all-gathered K/V (rank-major layout)."""

    @property
    def local_seqlen(self) -> int:
        return sum(b - a for a, b in self.token_ranges)

    @property
    def area(self) -> int:
        """(q, k) pairs this rank computes per head it owns (all heads, except Ulysses: heads / cp)."""
        return sum(s.area() for s in self.steps)

    def token_index(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``[local_seqlen]``: the global token id of each local row."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.token_ranges])


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def _types_list(attn_type_map: Any, n: int) -> list[Any]:
    if attn_type_map is None:
        return [0] * n
    if hasattr(attn_type_map, "tolist") and not isinstance(attn_type_map, str):
        attn_type_map = attn_type_map.tolist()
    if isinstance(attn_type_map, (list, tuple)):
        return list(attn_type_map)
    return [attn_type_map] * n  # one type (name, enum or code) for every slice


def plan_baseline(system: CPBaseline | str, q_ranges: Any, k_ranges: Any, attn_type_map: Any, total_seqlen: int,
                  cp_size: int, rank: int, *, num_heads_q: int, num_heads_kv: int) -> BaselinePlan:  # fmt: skip
    """Plan one rank's share of a baseline (pure; a ``ValueError`` before any collective could start).
    ``q_ranges`` / ``k_ranges``: ``[num_slices, 2]`` global ranges; ``attn_type_map``: per-slice types, one
    type for all, or None (all FULL); ``total_seqlen``: a multiple of cp (Ulysses) or 2 cp (ring, all-gather)."""
    try:
        system = CPBaseline(system)
    except ValueError:
        raise ValueError(f"`system` must be one of {[s.value for s in CPBaseline]}, got {system!r}") from None
    total = _positive(total_seqlen, "total_seqlen")
    cp = _positive(cp_size, "cp_size")
    hq, hkv = _positive(num_heads_q, "num_heads_q"), _positive(num_heads_kv, "num_heads_kv")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"`rank` must be an int in [0, cp_size={cp}), got {rank!r}")
    if hq % hkv:
        raise ValueError(f"`num_heads_q` ({hq}) must be a multiple of `num_heads_kv` ({hkv})")
    parts = cp if system == CPBaseline.ULYSSES else 2 * cp
    if total % parts:
        raise ValueError(f"{system.value} cuts the sequence into {parts} equal parts: `total_seqlen` ({total}) "
                         f"must be a multiple of {parts}; pad the sequence")  # fmt: skip
    if system == CPBaseline.ULYSSES and (hq % cp or hkv % cp):
        raise ValueError(f"ulysses splits heads across ranks: `num_heads_q` ({hq}) and `num_heads_kv` ({hkv}) must "
                         f"both be divisible by `cp_size` ({cp}); use ring_zigzag or allgather_kv, or a cp size "
                         "dividing the heads")  # fmt: skip
    qp, kp = as_int_pairs(q_ranges, "q_ranges"), as_int_pairs(k_ranges, "k_ranges")
    if len(qp) != len(kp):
        raise ValueError(f"`q_ranges` has {len(qp)} slices but `k_ranges` has {len(kp)}")
    types = _types_list(attn_type_map, len(qp))
    if len(types) != len(qp):
        raise ValueError(f"`attn_type_map` has {len(types)} entries for {len(qp)} slices")
    keep = [i for i, (q, k) in enumerate(zip(qp, kp)) if q[0] != q[1] and k[0] != k[1]]
    slices = normalize_mask([qp[i] for i in keep], [kp[i] for i in keep], [types[i] for i in keep], total, total)  # fmt: skip
    return _plan(system, tuple(slices), total, cp, rank, hq, hkv)


@functools.lru_cache(maxsize=256)
def _plan(system: CPBaseline, slices: tuple[TypedSlice, ...], total: int, cp: int, rank: int, hq: int, hkv: int) -> BaselinePlan:  # fmt: skip
    mine = token_ranges(system, total, cp, rank)
    if system == CPBaseline.ULYSSES:
        steps = (clip_slices(slices, [(0, total, 0)], [(0, total, 0)]),)
    elif system == CPBaseline.RING_ZIGZAG:
        steps = tuple(clip_slices(slices, _pieces(mine), _pieces(token_ranges(system, total, cp, (rank - j) % cp)))
                      for j in range(cp))  # fmt: skip
    else:
        shard = total // cp
        k_all = [p for s in range(cp) for p in _pieces(token_ranges(system, total, cp, s), s * shard)]
        steps = (clip_slices(slices, _pieces(mine), k_all),)
    return BaselinePlan(system, cp, rank, total, hq, hkv, mine, steps)


def shard_tokens(x: torch.Tensor, plan: BaselinePlan) -> torch.Tensor:
    """This rank's rows of a global ``[total_seqlen, ...]`` tensor, in the plan's local order (a copy)."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[0] != plan.total_seqlen:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"`x` must be a tensor with total_seqlen={plan.total_seqlen} rows on dim 0, got {got}")  # fmt: skip
    return torch.cat([x[a:b] for a, b in plan.token_ranges]).contiguous()


# -- local kernel calls -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=512)
def _kernel_args(sl: SliceList) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Ranges as CPU int32 tensors and types as a list, built once per slice list: FFA reads them on the
    host, and host inputs spare every kernel call a device -> host copy (a sync that would stall the queue)."""
    n = len(sl)
    q, k = (torch.tensor(r, dtype=torch.int32).reshape(n, 2) for r in (sl.q_ranges, sl.k_ranges))
    return q, k, list(sl.types)


def _fwd(q, k, v, sl: SliceList, out, lse, scale: float) -> None:
    if len(sl):
        ffa_fwd(q, k, v, *_kernel_args(sl), softmax_scale=scale, out=out, lse=lse)


def _bwd(do, q, k, v, out, lse, sl: SliceList, dq, dk, dv, scale: float) -> None:
    if len(sl):
        ffa_bwd(do, q, k, v, out, lse, *_kernel_args(sl), softmax_scale=scale, dq=dq, dk=dk, dv=dv)


def _new_out_lse(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    return out, torch.full(q.shape[:2], float("-inf"), dtype=acc, device=q.device)


def _empty_like(x: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
    """Uninitialised buffer like ``x`` (of ``shape`` if given); ``MAGI_FFA_POISON=1`` (tests) fills it with
    NaN so elements that no message or kernel wrote show up."""
    shape = tuple(x.shape if shape is None else shape)
    if os.environ.get("MAGI_FFA_POISON") == "1":
        return torch.full(shape, float("nan"), dtype=x.dtype, device=x.device)
    return x.new_empty(shape)


# -- Ulysses ------------------------------------------------------------------------------------------------
def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    """``x [cp, ...]``: block i goes to rank i; returns ``[cp, ...]`` with block i from rank i."""
    out = _empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def _seq_to_heads(xs: Sequence[torch.Tensor], cp: int, group) -> list[torch.Tensor]:
    """``[t, h_i, d]`` sequence shards -> ``[cp * t, h_i / cp, d]`` head shards (one all-to-all for all)."""
    t, d = xs[0].shape[0], xs[0].shape[2]
    widths = [x.shape[1] // cp for x in xs]
    send = _empty_like(xs[0], (cp, t, sum(widths), d))  # block i: every tensor's head group i (one copy each)
    off = 0
    for x, w in zip(xs, widths):
        send[:, :, off : off + w] = x.reshape(t, cp, w, d).transpose(0, 1)
        off += w
    return list(_a2a(send, group).reshape(cp * t, -1, d).split(widths, dim=1))


def _heads_to_seq(xs: Sequence[torch.Tensor], cp: int, group) -> list[torch.Tensor]:
    """``[cp * t, h_i, ...]`` head shards -> ``[t, cp * h_i, ...]`` sequence shards (one all-to-all)."""
    t, tail = xs[0].shape[0] // cp, xs[0].shape[2:]
    send = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)
    recv = _a2a(send.reshape(cp, t, -1, *tail), group)  # [head group, t, sum h_i, ...]
    return [p.transpose(0, 1).reshape(t, -1, *tail) for p in recv.split([x.shape[1] for x in xs], dim=2)]


class _UlyssesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BaselinePlan, group, scale: float):
        cp = plan.cp_size
        qh, kh, vh = _seq_to_heads([q, k, v], cp, group)
        out, lse = _new_out_lse(qh)
        _fwd(qh, kh, vh, plan.steps[0], out, lse, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.plan, ctx.group, ctx.scale = plan, group, scale
        (out_local,) = _heads_to_seq([out], cp, group)
        (lse_local,) = _heads_to_seq([lse], cp, group)
        ctx.mark_non_differentiable(lse_local)
        return out_local, lse_local

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        qh, kh, vh, out, lse = ctx.saved_tensors
        cp = ctx.plan.cp_size
        (doh,) = _seq_to_heads([grad_out.contiguous()], cp, ctx.group)
        acc = acc_dtype(qh.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (qh, kh, vh))
        _bwd(doh.contiguous(), qh, kh, vh, out, lse, ctx.plan.steps[0], dq, dk, dv, ctx.scale)
        # these gradients are complete (every key of these heads was local): send them in the input dtype
        dq, dk, dv = _heads_to_seq([g.to(qh.dtype) for g in (dq, dk, dv)], cp, ctx.group)
        return dq, dk, dv, None, None, None


# -- ring attention, zigzag -------------------------------------------------------------------------------
def _exchange(send: torch.Tensor, recv: torch.Tensor, plan: BaselinePlan, group, tag: int) -> list:
    """Send to the next rank of the ring, receive from the previous one (async)."""
    cp, r = plan.cp_size, plan.rank
    nxt, prv = (r + 1) % cp, (r - 1) % cp
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return dist.batch_isend_irecv(ops)


def _wait(works: list | None) -> None:
    for w in works or ():
        w.wait()


def _ring_fwd(q, k, v, plan: BaselinePlan, group, scale: float):
    hkv = k.shape[1]
    out, lse = _new_out_lse(q)
    kv = torch.cat([k, v], dim=1)  # K and V travel as one message
    for j in range(plan.cp_size):
        works, kv_next = None, None
        if j < plan.cp_size - 1:
            kv_next = _empty_like(kv)
            works = _exchange(kv, kv_next, plan, group, tag=0)  # next block in flight while this one computes
        _fwd(q, kv[:, :hkv], kv[:, hkv:], plan.steps[j], out, lse, scale)
        _wait(works)
        kv = kv_next if kv_next is not None else kv
    return out, lse


def _ring_bwd(do, q, k, v, out, lse, plan: BaselinePlan, group, scale: float):
    hkv = k.shape[1]
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.cat([k, v], dim=1)
    dkv_in, dkv_works = None, None
    for j in range(plan.cp_size):
        works, kv_next = None, None
        if j < plan.cp_size - 1:
            kv_next = _empty_like(kv)
            works = _exchange(kv, kv_next, plan, group, tag=0)
        # the partial dK/dV of the block in hand (owner (rank - j) % cp) travels with it round the ring
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        _bwd(do, q, kv[:, :hkv], kv[:, hkv:], out, lse, plan.steps[j], dq, dkv[:, :hkv], dkv[:, hkv:], scale)
        if dkv_works is not None:
            _wait(dkv_works)
            dkv += dkv_in
        if plan.cp_size > 1:
            dkv_in = _empty_like(dkv)
            dkv_works = _exchange(dkv, dkv_in, plan, group, tag=1)  # after step cp-1 it reaches its owner
        else:
            dkv_in = dkv
        _wait(works)
        kv = kv_next if kv_next is not None else kv
    _wait(dkv_works)
    return dq.to(q.dtype), dkv_in[:, :hkv].to(k.dtype), dkv_in[:, hkv:].to(v.dtype)


# -- all-gather K/V -----------------------------------------------------------------------------------------
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_kv(k: torch.Tensor, v: torch.Tensor, cp: int, group) -> torch.Tensor:
    kv = torch.cat([k, v], dim=1)
    kv_all = _empty_like(kv, (cp * kv.shape[0], *kv.shape[1:]))
    _all_gather(kv_all, kv, group=group)
    return kv_all


def _allgather_fwd(q, k, v, plan: BaselinePlan, group, scale: float):
    hkv = k.shape[1]
    kv_all = _gather_kv(k, v, plan.cp_size, group)
    out, lse = _new_out_lse(q)
    _fwd(q, kv_all[:, :hkv], kv_all[:, hkv:], plan.steps[0], out, lse, scale)
    return out, lse


def _allgather_bwd(do, q, k, v, out, lse, plan: BaselinePlan, group, scale: float):
    hkv, acc = k.shape[1], acc_dtype(q.dtype)
    kv_all = _gather_kv(k, v, plan.cp_size, group)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv_all = torch.zeros(kv_all.shape, dtype=acc, device=q.device)
    _bwd(do, q, kv_all[:, :hkv], kv_all[:, hkv:], out, lse, plan.steps[0], dq,
         dkv_all[:, :hkv], dkv_all[:, hkv:], scale)  # fmt: skip
    dkv = _empty_like(dkv_all, (k.shape[0], *dkv_all.shape[1:]))
    _reduce_scatter(dkv, dkv_all, group=group)
    return dq.to(q.dtype), dkv[:, :hkv].to(k.dtype), dkv[:, hkv:].to(v.dtype)


class _KVSchemeFn(torch.autograd.Function):
    """Ring or all-gather (K/V travel, q stays): ``scheme`` is its ``(fwd, bwd)`` pair; saves the local
    q, k, v and the output for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, plan: BaselinePlan, group, scale: float, scheme):
        out, lse = scheme[0](q, k, v, plan, group, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.group, ctx.scale, ctx.bwd = plan, group, scale, scheme[1]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.bwd(grad_out.contiguous(), q, k, v, out, lse, ctx.plan, ctx.group, ctx.scale)
        return dq, dk, dv, None, None, None, None


# -- public entry -------------------------------------------------------------------------------------------
_KV_SCHEMES = {CPBaseline.RING_ZIGZAG: (_ring_fwd, _ring_bwd), CPBaseline.ALLGATHER_KV: (_allgather_fwd, _allgather_bwd)}  # fmt: skip


def _validate(q, k, v, plan: BaselinePlan, group) -> None:
    if not isinstance(plan, BaselinePlan):
        raise TypeError(f"`plan` must be a BaselinePlan (from plan_baseline), got {type(plan).__name__}")
    for name, t, heads in zip("qkv", (q, k, v), (plan.num_heads_q, plan.num_heads_kv, plan.num_heads_kv)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3 or t.shape[0] != plan.local_seqlen or t.shape[1] != heads:
            raise ValueError(f"`{name}` must be [local_seqlen={plan.local_seqlen}, {heads}, head_dim] (this rank's "
                             f"rows, see shard_tokens), got {tuple(t.shape)}")  # fmt: skip
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"`q` must be float16/bfloat16/float32/float64, got {q.dtype}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype}, "
                         f"{q.device}/{k.device}/{v.device}")  # fmt: skip
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"q, k, v must share head_dim, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    if plan.cp_size > 1:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size != plan.cp_size or rank != plan.rank:
            raise ValueError(f"`plan` is for rank {plan.rank} of cp_size {plan.cp_size}, but this process is rank "
                             f"{rank} of a group of {size}: plan with this rank and the group's size")  # fmt: skip


def baseline_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BaselinePlan,
                  group: dist.ProcessGroup | None = None, softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Differentiable ``(out, lse)`` of this rank's rows (``shard_tokens``) by ``plan.system`` over ``group``
    (None: the default group); shapes and dtypes as in the module docstring (lse fp64 for fp64 inputs)."""
    _validate(q, k, v, plan, group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    # cp 1: every scheme is one local call on the same coordinates; the ring path does no communication
    if plan.system == CPBaseline.ULYSSES and plan.cp_size > 1:
        return _UlyssesFn.apply(q, k, v, plan, group, scale)
    scheme = _KV_SCHEMES[CPBaseline.RING_ZIGZAG if plan.cp_size == 1 else plan.system]
    return _KVSchemeFn.apply(q, k, v, plan, group, scale, scheme)
