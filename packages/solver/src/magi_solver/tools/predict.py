"""Predicted cost of one mask at one cp size: magi's plan against ring, all-gather K/V and Ulysses, all
priced by one cost model (`OverlapCostModel`, the one the runtime's dynamic overlap uses). Its kernel calls
are priced by the kernel law (`kernel_law`: tiles, key columns and rows of each call; the law `auto` would
pick for the whole mask) where one was fitted for the GPU kind, else by the profile's TFLOP/s; the record's
`rank_fwd_ms` / `rank_bwd_ms` are every rank's kernel time by that law (its H200 constants for a GPU kind
without one), the numbers the dispatch choice balances.

Per rank and per scheme (`L` = tokens per rank, `T` = remote K/V tokens, areas in (q, k) pairs):

* **magi**: the plan's own schedule (`plan_attention`, the runtime's plan, with the dynamic degree: host kernel, remote stages
  fetched by GroupCast while the previous stage computes, dK/dV sent back by GroupReduce). The fetch
  bandwidth of a rank is its tokens over the time of its slowest link: NVLink for sources on its node,
  the inter-node link for the others, both running at once.
* **ring** (zigzag shards): `cp - 1` steps, each passing one shard of K/V to the next rank while the
  previous step computes; the slowest link of the ring (inter-node once the ring spans nodes) sets the pace.
  Priced as `cp - 1` stages of `L` tokens each with the rank's area against that shard (each stage's call
  has `L` key columns under the law).
* **all-gather** (zigzag shards): one blocking all-gather of all other shards' K/V, one kernel, and a
  reduce-scatter of dK/dV in the backward: the cost model's degree-0 schedule with `T = total - L`, except
  that the reduce-scatter sums on the wire, so its dK/dV travel as the fp32 accumulator (a stage's reduce,
  `grad_reduce_bytes_per_elem`), where magi's degree-0 GroupReduce sends the kernel's dtype.
* **ulysses**: an all-to-all of q, k, v to head shards of the whole sequence, one kernel over the whole mask
  with `heads / cp` heads (under the law: every token a key column and a row of that call), an all-to-all of
  the output back (backward: dout in, dq, dk, dv back); needs both head counts divisible by cp.

TFLOP/s per GPU = FLOP / (slowest rank's time x cp) with FLOP(fwd) = 4 x area x heads_q x head_dim and
FLOP(bwd) = 2.5 x FLOP(fwd), as in the benchmarks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._assemble import Dispatched, build_plan
from .._slicing import clip_rows, host_area_of
from ..cost_model import BWD_FLOP_RATIO, OverlapCostModel
from ..dispatch import DispatchPlan, dispatch_slices, padded_seqlen
from ..kernel_law import KernelLaw, find_kernel_law, law_for_mask
from ..mask import normalize_mask, total_area
from ..plan import DistAttnPlan, PlanOptions, plan_attention
from ..pricing import price_plan
from .hardware import HardwareProfile, MaskFamily

__all__ = ["SCHEMES", "Workload", "padded_seqlen", "predict_cp"]

SCHEMES = ("magi", "ring", "all_gather", "ulysses")
"""The schemes `predict_cp` prices, in table order."""


@dataclass(frozen=True, slots=True)
class Workload:
    """The attention shape and planner settings of a prediction."""

    num_heads_q: int = 64
    num_heads_kv: int = 8
    head_dim: int = 128
    bytes_per_elem: int = 2
    """Bytes of one q/k/v element (2 for bf16)."""
    chunk_size: int | None = None
    """Dispatch chunk size in tokens; None: the runtime's choice per mask and cp size (`plan_attention`)."""
    max_degree: int = 4
    """Largest overlap degree the dynamic choice considers (the runtime's default)."""
    overlap_degree: int | None = None
    """None: dynamic (the runtime's default); an int: that many stages (0 = one merged stage)."""
    min_chunk_size: int = 512
    max_num_chunks: int = 64
    uneven_shard: bool = False
    """magi's dispatch without padding (`DispatchConfig(uneven_shard=True)`): ranks hold slightly different
    token counts. The baselines are priced on the padded sequence either way (ring's zigzag needs it)."""

    def __post_init__(self) -> None:
        for name in ("num_heads_q", "num_heads_kv", "head_dim", "bytes_per_elem", "chunk_size", "max_degree"):
            v = getattr(self, name)
            if name == "chunk_size" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {v!r}")
        if self.num_heads_q % self.num_heads_kv:
            raise ValueError(
                f"`num_heads_q` ({self.num_heads_q}) must be a multiple of `num_heads_kv` ({self.num_heads_kv})"
            )
        if self.overlap_degree is not None and self.overlap_degree < 0:
            raise ValueError(f"`overlap_degree` must be >= 0 or None, got {self.overlap_degree}")
        if not isinstance(self.uneven_shard, bool):
            raise TypeError(f"`uneven_shard` must be a bool, got {self.uneven_shard!r}")

    def model(
        self,
        hw: HardwareProfile,
        family: MaskFamily,
        comm_gbps: float | None = None,
        heads_div: int = 1,
        law: KernelLaw | None = None,
    ):
        """The cost model for this shape (heads divided by `heads_div`, for Ulysses' head shards); `law`: the
        kernel law its kernel calls are priced with (None: the profile's TFLOP/s)."""
        return OverlapCostModel(
            hw.cost_profile(family, comm_gbps),
            self.num_heads_q // heads_div,
            max(1, self.num_heads_kv // heads_div),
            self.head_dim,
            bytes_per_elem=self.bytes_per_elem,
            law=law,
        )

    def plan_options(self, cost_model: OverlapCostModel) -> PlanOptions:
        """The planner options of this workload, its schedules priced by `cost_model`."""
        return PlanOptions(
            # a chosen chunk size comes with a chosen placement and algorithm, as in the runtime
            dispatch_alg=None if self.chunk_size is None else "min_heap",
            overlap_degree=self.overlap_degree,
            overlap_mode="dynamic" if self.overlap_degree is None else "static",
            dynamic_max_degree=self.max_degree,
            min_chunk_size=self.min_chunk_size,
            max_num_chunks=self.max_num_chunks,
            cost_model=cost_model,
            uneven_shard=self.uneven_shard,
        )


@dataclass(frozen=True, slots=True)
class _Pricing:
    """What prices every scheme of one prediction: the hardware, the kernel family, the workload and the
    kernel law (None: the profile's TFLOP/s)."""

    hw: HardwareProfile
    family: MaskFamily
    workload: Workload
    law: KernelLaw | None

    def model(self, comm_gbps: float | None = None, heads_div: int = 1) -> OverlapCostModel:
        return self.workload.model(self.hw, self.family, comm_gbps, heads_div, law=self.law)


def _link_time(intra_bytes: float, inter_bytes: float, hw: HardwareProfile) -> float:
    return max(intra_bytes / (hw.nvlink_gbps * 1e9), inter_bytes / (hw.internode_gbps * 1e9))


def _effective_gbps(intra: float, inter: float, hw: HardwareProfile) -> float:
    """GB/s of a transfer of `intra` + `inter` tokens whose two parts run on their own links at once."""
    if inter <= 0:
        return hw.nvlink_gbps
    t = _link_time(intra, inter, hw)
    return (intra + inter) / t / 1e9


def _source_split(plan: DistAttnPlan, hw: HardwareProfile) -> list[tuple[int, int]]:
    """Per rank: (remote tokens from its own node, remote tokens from other nodes), over all stages."""
    m = sum(plan.transfer_matrix(s) for s in range(plan.num_stages))
    node = np.arange(plan.cp_size) // hw.gpus_per_node
    same = node[:, None] == node[None, :]
    return [(int(m[same[:, r], r].sum()), int(m[~same[:, r], r].sum())) for r in range(plan.cp_size)]


def _scheme(fwd_s: float, bwd_s: float, flop_fwd: float, cp: int, **extra: Any) -> dict[str, Any]:
    return {
        "fwd_ms": fwd_s * 1e3,
        "bwd_ms": bwd_s * 1e3,
        "fwd_tflops_per_gpu": flop_fwd / (fwd_s * cp) / 1e12 if fwd_s > 0 else 0.0,
        "bwd_tflops_per_gpu": BWD_FLOP_RATIO * flop_fwd / (bwd_s * cp) / 1e12 if bwd_s > 0 else 0.0,
        **extra,
    }


def _area_matrix(dispatch: DispatchPlan, slices: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    """int64 `[cp, cp]`: mask area of rank r's rows (row) against rank s's keys (column)."""
    cp = dispatch.cp_size
    clipped = clip_rows(dispatch, slices)
    out = np.zeros((cp, cp), dtype=np.int64)
    for s in range(cp):
        kmap = [(a, b, 0, 0) for a, b in dispatch.host_pairs(s)]
        for r in range(cp):
            out[r, s] = host_area_of(clipped[r], kmap)
    return out


def predict_cp(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    *,
    hardware: HardwareProfile,
    family: MaskFamily | str = MaskFamily.OTHER,
    workload: Workload | None = None,
) -> tuple[dict[str, Any], DistAttnPlan]:
    """Plan the mask at one cp size and price magi, ring, all-gather and Ulysses with one cost model.

    Args:
        q_ranges, k_ranges, attn_mask_type: the mask, as in `plan_attention`.
        total_seqlen: tokens of the mask; padded up to a multiple of `chunk_size * cp_size` (padding rows
            attend to nothing), except for magi's own plan when `workload.uneven_shard`.
        cp_size: number of ranks.
        hardware: kernel throughputs and links.
        family: which kernel throughput applies (`MaskFamily`).
        workload: heads, head dim, dtype size and planner settings (default `Workload()`).

    Returns:
        `(record, plan)`: a JSON-friendly dict (keys in `docs/quickstart.md`), and magi's `DistAttnPlan`.
    """
    w = workload or Workload()
    fam = MaskFamily(family)
    cp = int(cp_size)
    t0 = time.perf_counter()
    hw = hardware
    # one law prices every scheme's kernel calls: the one `auto` would pick for the whole mask on this GPU
    # kind, where one was fitted (else the profile's TFLOP/s)
    whole = normalize_mask(q_ranges, k_ranges, attn_mask_type, int(total_seqlen), int(total_seqlen))
    mask_law = law_for_mask(whole, int(total_seqlen), hw.name)
    law = mask_law if find_kernel_law(hw.name, mask_law.fwd.backend, mask_law.bwd.backend) else None
    pricing = _Pricing(hw, fam, w, law)
    nvl_model = pricing.model()
    # magi's plan: the runtime's one path (the chunk size chosen unless the workload gives one)
    plan = plan_attention(
        q_ranges,
        k_ranges,
        attn_mask_type,
        int(total_seqlen),
        cp,
        chunk_size=w.chunk_size,
        options=w.plan_options(nvl_model),
    )
    chunk = plan.dispatch.chunk_size
    padded = padded_seqlen(int(total_seqlen), cp, chunk)
    shard = padded // cp
    # magi's sequence: the padded one, or the mask's own length with uneven shards
    magi_total = plan.dispatch.total_seqlen
    slices = normalize_mask(q_ranges, k_ranges, attn_mask_type, magi_total, magi_total)
    area = total_area(slices)
    flop_fwd = 4.0 * area * w.num_heads_q * w.head_dim
    magi_shards = plan.dispatch.shard_seqlens
    split = _source_split(plan, hw) if cp > 1 else [(0, 0)]
    eff = [_effective_gbps(a, b, hw) for a, b in split]
    if cp > hw.gpus_per_node:  # re-price the degree choice with the inter-node links (same dispatch, choice)
        step = Dispatched(plan.dispatch, slices, plan.choice)
        plan = build_plan(step, w.plan_options(pricing.model(min(eff))))
    plan_s = time.perf_counter() - t0

    kv_tok = nvl_model.kv_bytes_per_token
    remote = plan.remote_tokens_per_rank
    schemes: dict[str, dict[str, Any]] = {}

    # magi: every rank's own schedule at its own effective bandwidth
    fwd = bwd = 0.0
    for r, rp in enumerate(plan.ranks):
        m = pricing.model(eff[r])
        args = (
            plan.overlap_degree,
            rp.host_area,
            [s.area for s in rp.stages],
            [s.num_remote_tokens for s in rp.stages],
            magi_shards[r],
        )
        fwd = max(fwd, m.schedule_time(*args, backward=False))
        bwd = max(bwd, m.schedule_time(*args, backward=True))
    schemes["magi"] = _scheme(
        fwd,
        bwd,
        flop_fwd,
        cp,
        imbalance=plan.imbalance,
        comm_tokens_per_rank=max(remote),
        comm_bytes_per_rank=max(remote) * kv_tok,
    )

    if cp == 1:
        for name in SCHEMES[1:]:
            schemes[name] = dict(schemes["magi"])
    else:
        schemes.update(_baselines(pricing, slices, padded, cp))

    # every rank's kernel time by the law (the numbers the dispatch choice balances), and its key columns
    price = price_plan(plan.dispatch, slices, mask_law.scaled(w.num_heads_q, w.head_dim), cross=False)
    fwd_r, bwd_r = price.fwd_ms, price.bwd_ms
    record = {
        "cp": cp,
        "total_seqlen": int(total_seqlen),
        "padded_seqlen": padded,
        "tokens_per_rank": max(magi_shards),
        "uneven_shard": w.uneven_shard,
        "chunk_size": chunk,
        "dispatch_alg": plan.dispatch.alg.value,
        "dispatch_reason": plan.choice.reason,
        "mask_area": area,
        "family": fam.value,
        "hardware": hw.name,
        "hardware_estimate": hw.estimate,
        "overlap_degree": plan.overlap_degree,
        "imbalance": plan.imbalance,
        "lower_bound_imbalance": plan.dispatch.lower_bound_imbalance,
        "rank_areas": list(plan.rank_areas),
        "remote_kv_tokens_max": max(remote),
        # the part of each rank's remote K/V from other nodes (0 inside one node), the busiest such rank
        "remote_kv_internode_tokens_max": max(b for _, b in split),
        "remote_kv_tokens_mean": sum(remote) / cp,
        "remote_kv_bytes_max": max(remote) * kv_tok,
        # the receive buffers of the busiest rank: the K and V of every token it fetches
        "recv_buffer_bytes_max": max(remote) * kv_tok,
        "rank_fwd_ms": [float(x) for x in fwd_r],
        "rank_bwd_ms": [float(x) for x in bwd_r],
        "time_imbalance": price.time_imbalance,
        "key_columns_max": float(np.max((np.asarray(magi_shards) + np.asarray(remote)) / 128)),
        "kernel_law": f"{mask_law.gpu} {mask_law.backend}"
        + ("" if law else " (ranks only; schemes by profile)"),
        # the baselines' geometry: the padded sequence in equal shards, every other shard moves
        "ring_kv_tokens_per_rank": padded - shard,
        "all_gather_kv_tokens_per_rank": padded - shard,
        "kv_bytes_per_token": kv_tok,
        "plan_seconds": plan_s,
        "schemes": schemes,
    }
    return record, plan


def _baselines(
    pricing: _Pricing, slices: list[tuple[int, int, int, int, int]], padded: int, cp: int
) -> dict[str, dict[str, Any]]:
    """Ring, all-gather and Ulysses on the padded sequence (`padded` tokens, zigzag shards over `cp > 1`
    ranks), by scheme name."""
    hw, w = pricing.hw, pricing.workload
    shard = padded // cp
    area = total_area(slices)
    flop_fwd = 4.0 * area * w.num_heads_q * w.head_dim
    schemes: dict[str, dict[str, Any]] = {}
    spans_nodes = cp > hw.gpus_per_node
    link = hw.internode_gbps if spans_nodes else hw.nvlink_gbps
    zig = dispatch_slices(slices, padded, cp, padded // (2 * cp), "zigzag")
    am = _area_matrix(zig, slices)
    m = pricing.model(link)
    kv_tok = m.kv_bytes_per_token
    others = padded - shard

    ring_f = ring_b = ag_f = ag_b = 0.0
    for r in range(cp):
        stage_areas = [int(am[r, (r - i) % cp]) for i in range(1, cp)]
        ring_args = (cp - 1, int(am[r, r]), stage_areas, [shard] * (cp - 1), shard)
        ring_f = max(ring_f, m.schedule_time(*ring_args, backward=False))
        ring_b = max(ring_b, m.schedule_time(*ring_args, backward=True))
        ag_args = (0, int(am[r, r]), [sum(stage_areas)], [others], shard)
        ag_f = max(ag_f, m.schedule_time(*ag_args, backward=False))
        ag_reduce_fp32 = m.reduce(others) - m.reduce(others, merged=True)  # see the module docstring
        ag_b = max(ag_b, m.schedule_time(*ag_args, backward=True) + ag_reduce_fp32)
    imb = zig.imbalance
    schemes["ring"] = _scheme(
        ring_f,
        ring_b,
        flop_fwd,
        cp,
        imbalance=imb,
        comm_tokens_per_rank=others,
        comm_bytes_per_rank=others * kv_tok,
    )
    schemes["all_gather"] = _scheme(
        ag_f,
        ag_b,
        flop_fwd,
        cp,
        imbalance=imb,
        comm_tokens_per_rank=others,
        comm_bytes_per_rank=others * kv_tok,
    )

    if w.num_heads_q % cp or w.num_heads_kv % cp:
        schemes["ulysses"] = {
            "skipped": f"heads {w.num_heads_q}:{w.num_heads_kv} not divisible by cp {cp}",
            "imbalance": 1.0,
        }
        return schemes
    um = pricing.model(heads_div=cp)
    peers_intra = min(hw.gpus_per_node, cp) - 1
    peers_inter = cp - 1 - peers_intra
    per_peer = shard / cp * w.head_dim * w.bytes_per_elem  # bytes of one head's piece to one peer

    def a2a(heads: int) -> float:
        b = per_peer * heads
        return hw.base.comm_latency_s + _link_time(b * peers_intra, b * peers_inter, hw)

    hq, hkv = w.num_heads_q, w.num_heads_kv
    # one call over the whole (padded) sequence with heads / cp heads: every key a column, every row a row
    fwd = a2a(hq + 2 * hkv) + um.kernel(area, False, keys=padded, rows=padded) + a2a(hq)
    bwd = a2a(hq) + um.kernel(area, True, keys=padded, rows=padded) + a2a(hq + 2 * hkv)
    sent_fwd = per_peer * (peers_intra + peers_inter) * (2 * hq + 2 * hkv)
    schemes["ulysses"] = _scheme(
        fwd, bwd, flop_fwd, cp, imbalance=1.0, comm_tokens_per_rank=None, comm_bytes_per_rank=int(sent_fwd)
    )
    return schemes
