"""Runtime measurements on one GPU: cp = 1 overhead and simulated context parallelism.
What it measures and how to run it: docs/benchmarks/cases.md (sim)."""

import datetime
import functools
import importlib
import itertools
import os
import statistics
from collections.abc import Callable

import torch
import triton

from benchmarks import common
from benchmarks.cli import add_common, names, run_module, table, usage_error, write_json
from benchmarks.common import SCALING_MASKS, kv_total, make_mask
from magi_attention import DispatchConfig, DistAttnConfig
from magi_attention.api import calc_attn, magi_attn_flex_key
from magi_attention.config import KernelBackend
from magi_attention.simulate import auto_launchers, checked_slices, kernel_launchers
from magi_solver import DispatchAlg, PlanOptions, plan_attention

HQ, HKV, D = 64, 8, 128
# The CPU (torch path) runs the same code at toy sizes to smoke-test the script: MAGI_BENCH_DEVICE=cpu.
DEVICE = os.environ.get("MAGI_BENCH_DEVICE", "cuda")
BACKENDS = ("auto", "fa4", "cudnn", "triton", "torch")
"""``--kernel-backend`` entries (torch: the CPU smoke test)."""


def raw_attn_func(backend: KernelBackend):
    """The backend's own single-call autograd entry (the cp = 1 yardstick; magi_ffa: Triton on a GPU, its torch
    path on the CPU)."""
    name = {KernelBackend.FA4: "magi_ffa_fa4", KernelBackend.CUDNN: "magi_ffa_cudnn"}.get(backend, "magi_ffa")
    return importlib.import_module(name).flex_flash_attn_func


NVLINK_BPS, IB_BPS = 450e9, 50e9


def _bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds: CUDA events through triton's do_bench, or a host clock on the CPU smoke test."""
    if DEVICE == "cuda":
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return common.host_median_ms(fn, 3)


def _events_ms(fn, warmup: int = 2, iters: int = 5) -> float:
    """Median ms of `fn` by CUDA events (per-rank timing in the simulation: cheap enough for 64 ranks)."""
    return statistics.median(common.times_ms(fn, iters, events=True, warmup=warmup)) if DEVICE == "cuda" else _bench(fn)  # fmt: skip


def _whole_mask(mask: str, total: int, requires_grad: bool = False):
    """Random bf16 ``(q, k, v, dout)`` of ``mask`` over ``total`` tokens, and its ranges and types as host int32
    tensors (no device -> host sync per call)."""
    dev, tk = torch.device(DEVICE), kv_total(mask, total)
    q, k, v = (torch.randn(n, h, D, device=dev, dtype=torch.bfloat16, requires_grad=requires_grad)
               for n, h in ((total, HQ), (tk, HKV), (tk, HKV)))  # fmt: skip
    do = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16)
    return (q, k, v, do), [torch.tensor(x, dtype=torch.int32) for x in make_mask(mask, total)]


def bench_cp1_overhead(total: int, mask: str, backend: KernelBackend) -> dict:
    (q, k, v, do), (qr, kr, tr) = _whole_mask(mask, total, requires_grad=True)
    config = DistAttnConfig(kernel_backend=backend)
    key = magi_attn_flex_key(*make_mask(mask, total), total, k.shape[0], HQ, HKV, D, None, config)
    raw_fn = raw_attn_func(backend)
    with torch.no_grad():
        raw = _bench(lambda: raw_fn(q, k, v, qr, kr, tr), warmup=20, rep=100)
        ours = _bench(lambda: calc_attn(q, k, v, key), warmup=20, rep=100)
    raw_fb = _bench(lambda: raw_fn(q, k, v, qr, kr, tr)[0].backward(do), warmup=10, rep=50)
    ours_fb = _bench(lambda: calc_attn(q, k, v, key)[0].backward(do), warmup=10, rep=50)
    return {"mask": mask, "tokens": total, "backend": backend.value, "raw_ffa_ms": raw, "calc_attn_ms": ours,
            "overhead": ours / raw - 1, "raw_fwd_bwd_ms": raw_fb, "calc_attn_fwd_bwd_ms": ours_fb,
            "overhead_fwd_bwd": ours_fb / raw_fb - 1}  # fmt: skip


@functools.cache
def single_gpu_tflops(mask: str, total: int, backend: KernelBackend) -> tuple[float, float]:
    """The backend's throughput on the WHOLE mask in one call (fwd, bwd TFLOP/s): the simulated-cp yardstick."""
    (q, k, v, do), tables = _whole_mask(mask, total)
    kern, sl = kernel_launchers(backend), checked_slices(*tables)  # the runtime's entry, as the ranks'
    out, lse = kern.fwd_slices(q, k, v, sl)
    t_f = _events_ms(lambda: kern.fwd_slices(q, k, v, sl))  # median of 5 after 2: one reading moved 15 %
    t_b = _events_ms(lambda: kern.bwd_slices(do, q, k, v, out, lse, sl))
    flops = 4 * common.mask_area(*make_mask(mask, total)) * HQ * D
    return flops / (t_f * 1e-3) / 1e12, 2.5 * flops / (t_b * 1e-3) / 1e12


def _once_ms(fn, queued: bool = False) -> tuple[float, object]:
    """(ms, result) of one call of ``fn``: CUDA events, or a host clock on the CPU smoke test. ``queued``: behind
    about 5 ms of GPU sleep, so the host issues the call ahead of the GPU, as in a training step's later layers."""
    if queued and DEVICE == "cuda":
        torch.cuda._sleep(10_000_000)  # cycles, about 5 ms on an H200: longer than a rank call's host work
    return common.once_ms(fn, events=DEVICE == "cuda")


def _rank_step(q: torch.Tensor, do: torch.Tensor, calls: list, kern, queued: bool = False) -> tuple[float, float]:  # fmt: skip
    """One forward and one backward (ms) of a rank's calls (`common.rank_kernel_calls`) on ``kern``, as the
    runtime: one call (the merged stage) writes out / lse and the gradients itself, with the runtime's K/V
    concatenation before it and the dK/dV it reduces after; more calls: an accumulator, fp32 gradients. ``queued``:
    each direction timed behind GPU work (`_once_ms`), the GPU's time without the host's before it."""
    if len(calls) == 1:
        sl, kk, vv = calls[0]
        # own keys: the query shard's count, as in self-attention (a cross-attention mask's key shard differs,
        # which moves only these copies' share of rows)
        n = min(q.shape[0], kk.shape[0])

        def fwd():
            torch.cat([kk[:n], vv[:n]], dim=1)  # dist_attn joins the own K/V; the received rows land behind
            return kern.fwd_slices(q, kk, vv, sl)

        t_f, (out, lse) = _once_ms(fwd, queued)

        def bwd():
            torch.cat([kk[:n], vv[:n]], dim=1)
            _, dk, dv = kern.bwd_slices(do, q, kk, vv, out, lse, sl)
            # as dist_attn: the own keys' dK/dV become the fp32 sum the owners reduce into; the received
            # keys' go back in the kernel's dtype
            torch.cat([dk[:n], dv[:n]], dim=1, out=dk.new_empty((n, 2 * dk.shape[1], dk.shape[2]), dtype=torch.float32))  # fmt: skip
            torch.cat([dk[n:], dv[n:]], dim=1)

        return t_f, _once_ms(bwd, queued)[0]

    def fwd():
        sl, kk, vv = calls[0]
        out, lse = kern.fwd_slices(q, kk, vv, sl)
        if len(calls) > 2:
            out = out.float()
        for sl, kk, vv in calls[1:]:
            kern.fwd_slices(q, kk, vv, sl, out=out, lse=lse)
        return out, lse

    t_f, (out, lse) = _once_ms(fwd, queued)
    o16 = out.to(q.dtype)

    def bwd():
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        for sl, kk, vv in calls:
            dkv = [torch.zeros(kk.shape, device=q.device, dtype=torch.float32) for _ in range(2)]
            kern.bwd_slices(do, q, kk, vv, o16, lse, sl, dq=dq, dk=dkv[0], dv=dkv[1])

    return t_f, _once_ms(bwd, queued)[0]


def _profile_rank(q: torch.Tensor, do: torch.Tensor, calls: list, kern, path: str, title: str) -> None:
    """torch.profiler over three forward + backward steps of one rank: its kernels and host ops by device
    time, appended to ``path`` under ``title`` (one file for every row: the device runner returns few files)."""
    cuda = DEVICE == "cuda"
    table, _ = common.profile_table(lambda: [_rank_step(q, do, calls, kern) for _ in range(3)], cuda,
                                    "cuda_time_total" if cuda else "cpu_time_total")  # fmt: skip
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(f"== {title}\n{table}\n\n")


QUICK_REPEAT_MS = 100.0
"""A rank whose first forward + backward took less than this runs again and the second counts: its first
call builds the rank problem's launch data (a mask plan, metadata), a few to tens of ms that would rank short
steps by their build time rather than their kernels when choosing the candidates for the slowest rank."""


def quick_step(step: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """(fwd ms, bwd ms) of one rank in the quick round: ``step()`` once, again when it was short
    (`QUICK_REPEAT_MS`)."""
    t = step()
    return step() if sum(t) < QUICK_REPEAT_MS else t


def pick_ranks(quick_fwd: list[float], quick_bwd: list[float], areas: list[int], remote: list[int],
               top: int = 2) -> list[int]:  # fmt: skip
    """The ranks timed in full after one quick round of every rank: the ``top`` slowest by the quick forward
    and by the quick backward, the rank the plan gives the most area and the one with the most remote K/V
    tokens (ties: the lowest rank)."""

    def first(xs: list, n: int) -> list[int]:
        return sorted(range(len(xs)), key=lambda i: -xs[i])[:n]

    return sorted({*first(quick_fwd, top), *first(quick_bwd, top), *first(areas, 1), *first(remote, 1)})


DEFAULT_ALG = "default"
"""``--dispatch-algs`` entry for the runtime's default dispatch (``DispatchConfig()``: chosen per mask)."""


def dispatch_alg(name: str) -> DispatchAlg | None:
    """``--dispatch-algs`` entry ``name`` as the planner takes it: None for ``default`` (chosen per mask and cp
    size), else ``DispatchConfig(alg=name).alg`` (a ValueError listing the algorithms when unknown)."""
    return None if name == DEFAULT_ALG else DispatchConfig(alg=name).alg


def make_plan(mask: str, cp: int, tokens_per_gpu: int, degree: int, chunk: int | None = None,
              alg: str = DEFAULT_ALG):  # fmt: skip
    """The runtime's own plan of `mask` (`plan_attention`): the chunk size and dispatch algorithm chosen per
    mask and cp size unless `chunk` is given (then min_heap, as `DispatchConfig(chunk_size=chunk)`); `alg`
    other than ``default``: that algorithm (`dispatch_alg`), its chunk size chosen unless `chunk` is given."""
    total = tokens_per_gpu * cp
    q_ranges, k_ranges, types = make_mask(mask, total)
    asked = dispatch_alg(alg)
    options = PlanOptions(dispatch_alg=asked if asked is not None else None if chunk is None else "min_heap",
                          overlap_degree=degree, min_chunk_size=512 if chunk is None else min(512, chunk))  # fmt: skip
    # cross-attention: key/value shards of their own, as the runtime cuts them
    cross = {"total_seqlen_k": kv_total(mask, total)} if kv_total(mask, total) != total else {}
    plan = plan_attention(q_ranges, k_ranges, types, total, cp, chunk_size=chunk, options=options, **cross)
    return total, plan


def auto_kernel(mask: str, total: int, plan):
    """The launchers `kernel_backend="auto"` picks for this simulated plan on this GPU (the runtime's rule,
    every backend this process can run as a candidate; the backward's backend may differ)."""
    import numpy as np

    rows = [np.asarray(plan.dispatch.position_ids(r)) for r in range(plan.cp_size)]
    kern, reason = auto_launchers(*make_mask(mask, total), rows, plan.kv_layout, D)
    print(f"# auto on {mask} cp{plan.cp_size}: {kern.backend} ({reason})", flush=True)
    return kern


def plan_summary(mask: str, cp: int, tokens_per_gpu: int, degree: int, alg: str = DEFAULT_ALG) -> dict:
    """What needs no GPU: compute balance and the K/V bytes the busiest rank receives (bf16 K and V)."""
    _, plan = make_plan(mask, cp, tokens_per_gpu, degree, alg=alg)
    areas = [r.host_area + sum(s.area for s in r.stages) for r in plan.ranks]
    worst_bytes = max(sum(s.num_remote_tokens for s in r.stages) for r in plan.ranks) * 2 * HKV * D * 2
    return {"mask": mask, "cp": cp, "dispatch_alg_asked": alg, "dispatch_alg": plan.dispatch.alg.value,
            "imbalance": max(areas) * cp / sum(areas), "remote_mib": worst_bytes / 2**20,
            "comm_ms_nvlink": worst_bytes / NVLINK_BPS * 1e3, "comm_ms_ib": worst_bytes / IB_BPS * 1e3}  # fmt: skip


_FAMILY = {
    "video_block_causal": "block_causal", "cross_varlen": "other", "docs4k_causal": "varlen_causal",
    "docs4k_full": "varlen_full", "short_docs_causal": "varlen_causal", "docs4k_window2048": "sliding_window",
    "video_clips": "block_causal",
}  # fmt: skip
"""The cost model's kernel-throughput class of each mask (`MaskFamily`; the others are their own name)."""

# MagiAttention's published H100 curve (native group collectives, 8k tokens per GPU, heads 64:8, d 128):
# TFLOP/s per GPU at cp 8 and cp 64, from ../shared/reference/anchors.md (B.9); other cp sizes unpublished
PUBLISHED_H100 = {
    ("full", "fwd"): {8: 665, 64: 628}, ("causal", "fwd"): {8: 645, 64: 594}, ("causal", "bwd"): {8: 529, 64: 529},
    ("varlen_full", "fwd"): {8: 535, 64: 400}, ("varlen_causal", "fwd"): {8: 459, 64: 237},
    ("varlen_causal", "bwd"): {8: 360, 64: 264},
}  # fmt: skip


def predicted_step(mask: str, cp: int, tokens_per_gpu: int, degree: int) -> dict:
    """The cost model's step per GPU for the runtime's plan (`magi_solver.tools.predict`, the H200 profile:
    measured kernel rates, NVLink inside 8-GPU nodes, 50 GB/s per GPU between nodes): fwd / bwd ms and
    TFLOP/s per GPU of the slowest rank, communication included. Computed, not measured."""
    from magi_solver.tools.hardware import get_hardware
    from magi_solver.tools.predict import Workload, predict_cp

    total = tokens_per_gpu * cp
    q, k, t = make_mask(mask, total)
    if kv_total(mask, total) != total:
        return {}  # cross-attention: the predictor plans self-attention masks only
    rec, _ = predict_cp(
        q, k, t, total, cp, hardware=get_hardware("h200"), family=_FAMILY.get(mask, mask),
        workload=Workload(num_heads_q=HQ, num_heads_kv=HKV, head_dim=D, overlap_degree=degree),
    )  # fmt: skip
    m = rec["schemes"]["magi"]
    # the plan priced: the runtime's default dispatch, whichever --dispatch-algs entry the row measured
    return {"dispatch_alg": rec["dispatch_alg"]} | {k: m[k] for k in ("fwd_ms", "bwd_ms", "fwd_tflops_per_gpu", "bwd_tflops_per_gpu")}  # fmt: skip


def scaling_rows(sim: list[dict]) -> list[dict]:
    """Scaling efficiency per simulated row: `E = T_one_gpu / (cp x T_slowest_rank)`, i.e. the TFLOP/s per
    GPU the slowest rank implies over the one-GPU rate on the same mask (the fastest explicit backend's rate of
    the same mask and cp: the strictest yardstick)."""
    out = []
    for r in sim:
        singles = [o for o in sim if (o["mask"], o["cp"]) == (r["mask"], r["cp"]) and "single_fwd" in o]
        row = {k: r.get(k) for k in ("mask", "cp", "kernel_backend", "backend", "chunk_size", "dispatch_alg",
               "remote_kv_tokens_max", "remote_kv_tokens_mean", "timed_ranks")}  # fmt: skip
        row |= {"dispatch_alg_asked": r.get("dispatch_alg_asked", DEFAULT_ALG), "predicted": r.get("predicted", {})}  # fmt: skip
        if singles:
            one_f = max(o["single_fwd"] for o in singles)
            one_b = max(o["single_bwd"] for o in singles)
            row["single_tokens"] = singles[0]["single_tokens"]
            row["E_fwd"], row["E_bwd"] = r["tflops_fwd"] / one_f, r["tflops_bwd"] / one_b
            if r.get("slowest_fwd_ms_queued"):  # the same work timed queued
                row |= {f"E_{w}_queued": row[f"E_{w}"] * r[f"slowest_{w}_ms"] / r[f"slowest_{w}_ms_queued"] for w in ("fwd", "bwd")}  # fmt: skip
        for way in ("fwd", "bwd"):
            row[f"published_h100_{way}"] = PUBLISHED_H100.get((r["mask"], way), {}).get(r["cp"])
        out.append(row)
    return out


def simulate_cp(mask: str, cp: int, tokens_per_gpu: int, degree: int, backend: KernelBackend, rounds: int = 5,
                top: int = 2, profile_path: str | None = None, alg: str = DEFAULT_ALG) -> dict:  # fmt: skip
    """Every rank's forward and backward on ``backend`` (``auto``: the launchers the runtime would pick for
    this plan) timed once, then ``rounds`` interleaved rounds of the candidates for the slowest rank
    (`pick_ranks`); the slowest rank's times (medians of those rounds) and the throughput they imply. `alg`:
    the ``--dispatch-algs`` entry the plan is made with (`make_plan`)."""
    total, plan = make_plan(mask, cp, tokens_per_gpu, degree, alg=alg)
    dev = torch.device(DEVICE)
    shard = plan.dispatch.shard_seqlen  # the chosen chunk may pad the sequence
    kv_shard = shard if plan.kv_layout is None else plan.kv_layout.shard_seqlen
    max_remote = max(r.num_remote_tokens for r in plan.ranks)
    # rk / rv: one buffer of stand-in keys for every rank (at degree 0 the merged call's own and received keys)
    q, do, k, v, rk, rv = (torch.randn(n, h, D, device=dev, dtype=torch.bfloat16) for n, h in ((shard, HQ), (shard, HQ),
                           (kv_shard, HKV), (kv_shard, HKV), (kv_shard + max_remote, HKV), (kv_shard + max_remote, HKV)))  # fmt: skip
    kern = auto_kernel(mask, total, plan) if backend == KernelBackend.AUTO else kernel_launchers(backend)
    resolved = kern.backend.value
    if kern.backward_backend != kern.backend:
        resolved += "/" + kern.backward_backend.value
    rows, calls = [], []
    for rp in plan.ranks:
        calls.append(common.rank_kernel_calls(rp, plan.overlap_degree, k, v, rk, rv))
        area = rp.host_area + sum(s.area for s in rp.stages)
        comm_bytes = [s.num_remote_tokens * 2 * HKV * D * 2 for s in rp.stages]
        own, recv = rp.local_seqlen, rp.num_remote_tokens  # the kernel law's counts (fit_kernel_law.py)
        rows.append({"rank": rp.rank, "area": area, "stage_bytes": comm_bytes, "local_tokens": own,
                     "recv_tokens": recv, "tiles": area / 128**2, "key_columns": (own + recv) / 128,
                     "rows": -(-own // 128)})  # fmt: skip
    _rank_step(q, do, calls[0], kern)  # warm-up: compiles, workspaces
    quick = [quick_step(lambda c=c: _rank_step(q, do, c, kern)) for c in calls]
    timed = pick_ranks(*zip(*quick), [r["area"] for r in rows], [sum(r["stage_bytes"]) for r in rows], top)
    full = {i: [] for i in timed}
    for i in timed:  # untimed: the quick round's later ranks may have evicted their launch metadata (LRU)
        _rank_step(q, do, calls[i], kern)
    for _ in range(rounds):  # interleaved: a drift of clock or temperature touches every candidate alike
        for i in timed:
            full[i].append(_rank_step(q, do, calls[i], kern) + _rank_step(q, do, calls[i], kern, queued=True))
    for i, r in enumerate(rows):
        r["quick_fwd_ms"], r["quick_bwd_ms"] = quick[i]
        r["fwd_ms"], r["bwd_ms"], r["fwd_ms_queued"], r["bwd_ms_queued"] = (statistics.median(t) for t in zip(*full[i])) if i in full else (*quick[i], None, None)  # fmt: skip
        r["full_timing"] = i in full
    if profile_path:
        slowest = max(timed, key=lambda i: rows[i]["bwd_ms"])
        _profile_rank(q, do, calls[slowest], kern, profile_path, f"{mask} cp {cp} {backend.value} rank {slowest}")  # fmt: skip
    total_area = sum(r["area"] for r in rows)
    flops_f = 4 * total_area * HQ * D
    worst_f = max(rows[i]["fwd_ms"] for i in timed)
    worst_b = max(rows[i]["bwd_ms"] for i in timed)
    worst_bytes = max(sum(r["stage_bytes"]) for r in rows)
    # chunk_size: the runtime's choice (a later reader rebuilds this plan); quick_max_over_slowest > 1: a rank
    # left out of the full timing was slower in the quick round than the slowest timed one
    return {"mask": mask, "cp": cp, "kernel_backend": backend.value, "backend": resolved,
            "tokens_per_gpu": tokens_per_gpu, "degree": degree, "chunk_size": plan.dispatch.chunk_size,
            "dispatch_alg": plan.dispatch.alg.value, "dispatch_alg_asked": alg,
            "remote_kv_tokens_max": max(plan.remote_tokens_per_rank),
            "remote_kv_tokens_mean": sum(plan.remote_tokens_per_rank) / cp,
            "predicted": predicted_step(mask, cp, tokens_per_gpu, degree),
            "imbalance": max(r["area"] for r in rows) * cp / total_area, "timed_ranks": timed, "rounds": rounds,
            "quick_max_over_slowest": max((max(f / worst_f, b / worst_b) for i, (f, b) in enumerate(quick)
                                           if i not in full), default=0.0),
            "slowest_fwd_ms": worst_f, "slowest_bwd_ms": worst_b, "tflops_fwd": flops_f / (worst_f * 1e-3 * cp) / 1e12,
            "tflops_bwd": 2.5 * flops_f / (worst_b * 1e-3 * cp) / 1e12, "comm_ms_nvlink": worst_bytes / NVLINK_BPS * 1e3,
            "comm_ms_ib": worst_bytes / IB_BPS * 1e3, "ranks": rows,
            **{f"slowest_{w}_ms_queued": max(rows[i][f"{w}_ms_queued"] for i in timed) for w in ("fwd", "bwd")}}  # fmt: skip


def _case(row: dict) -> tuple:
    """What makes rows comparable: the mask, cp, degree and the dispatch asked for."""
    return row["mask"], row["cp"], row["degree"], row.get("dispatch_alg_asked", DEFAULT_ALG)


def auto_over_fastest(row: dict, rows: list[dict]) -> str:
    """For an ``auto`` row: the fastest explicit backend's slowest-rank time over auto's, per direction
    (>= 1: auto is at least as fast), among the rows of the same mask, cp, degree and dispatch asked for."""
    if row["kernel_backend"] != "auto":
        return ""
    same = [o for o in rows if o["kernel_backend"] != "auto" and _case(o) == _case(row)]
    if not same:
        return "n/a"
    return " / ".join(f"{min(o[t] for o in same) / row[t]:.2f}" for t in ("slowest_fwd_ms", "slowest_bwd_ms"))


def add_arguments(ap) -> None:
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--cps", default="8,16,32,64")
    add_common(ap, masks="full,causal,varlen_full,varlen_causal")
    ap.add_argument("--dispatch-algs", "--dispatch-alg", default=DEFAULT_ALG, help="comma-separated dispatch "
                    f"algorithms, each mask and cp planned with each (a row apiece): '{DEFAULT_ALG}' (the runtime's "
                    f"choice per mask) or a DispatchAlg name ({', '.join(a.value for a in DispatchAlg)}), its chunk size chosen")  # fmt: skip
    ap.add_argument("--degree", type=int, default=2)
    ap.add_argument("--cp1-tokens", type=int, default=32768)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plan-only", action="store_true", help="balance and communication only (no GPU needed)")
    ap.add_argument("--kernel-backend", default="fa4", help=f"comma-separated, from {BACKENDS}: the simulated ranks "
                    "run on each (auto: what the runtime would pick for the plan); beside auto an explicit backend "
                    "is only the one-GPU yardstick (and cp = 1 rows), unless --simulate-explicit")  # fmt: skip
    ap.add_argument("--single-backend", default="", help="more one-GPU yardstick backends")
    ap.add_argument("--simulate-explicit", action="store_true", help="simulate explicit ones beside auto")
    ap.add_argument("--no-single", action="store_true", help="skip the single-GPU call on the whole mask")
    ap.add_argument("--no-cp1", action="store_true", help="skip the cp = 1 overhead rows")
    ap.add_argument("--single-max-tokens", type=int, default=131072)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds of the candidate ranks")
    ap.add_argument("--rounds-dense", type=int, default=1, help="--rounds of full and causal at cp >= 32")
    ap.add_argument("--candidates", type=int, default=2, help="quick round's slowest ranks, per way")
    ap.add_argument("--profile", default=None, help="file: torch.profiler table of each row's slowest rank, appended")  # fmt: skip
    ap.add_argument("--scaling", action="store_true", help="also print the scaling table: E = T_one_gpu / (cp x "
                    "T_slowest_rank), remote K/V per rank, the cost model's predicted step per GPU beside "
                    "MagiAttention's published H100 curve")  # fmt: skip


def main(args) -> int:
    masks, algs = names(args.masks), names(args.dispatch_algs)
    if bad := [m for m in masks if m not in SCALING_MASKS]:
        usage_error(f"--masks: unknown {bad}, choose from {SCALING_MASKS}")
    for a in algs:
        try:
            dispatch_alg(a)
        except ValueError as e:
            usage_error(f"--dispatch-algs: {a!r}: {e} (or '{DEFAULT_ALG}')")
    asked, singles = [b.strip() for b in args.kernel_backend.split(",")], names(args.single_backend)
    if bad := [b for b in asked + singles if b not in BACKENDS]:
        usage_error(f"--kernel-backend: unknown {bad}, choose from {BACKENDS}")
    backends = [KernelBackend(b) for b in asked]
    if KernelBackend.AUTO in backends and not args.simulate_explicit:
        backends = [KernelBackend.AUTO]
    explicit = [KernelBackend(b) for b in dict.fromkeys(asked + singles) if b != "auto"]
    if not explicit and not (args.no_single and args.no_cp1):
        usage_error("--kernel-backend auto alone simulates cp only: add --no-single --no-cp1 or an explicit backend")  # fmt: skip
    if args.plan_only:
        rows = []
        for mask, cp, alg in itertools.product(masks, map(int, args.cps.split(",")), algs):
            r = plan_summary(mask, cp, args.tokens_per_gpu, args.degree, alg)
            rows.append([mask, cp, _alg_cell(r), f"{r['imbalance']:.3f}", f"{r['remote_mib']:.1f}",
                         f"{r['comm_ms_nvlink']:.2f}", f"{r['comm_ms_ib']:.2f}"])  # fmt: skip
        print("\n".join(table(["mask", "cp", "dispatch", "imbalance", "remote K/V MiB (busiest rank)",
                                "comm ms @450GB/s", "comm ms @50GB/s"], rows)))  # fmt: skip
        return 0
    name = torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else "cpu"
    header = (f"{datetime.date.today()} | {name} | torch {torch.__version__} | triton {triton.__version__} | "
              f"heads {HQ}:{HKV}, d {D}, bf16 | kernel backends {','.join(asked)}")  # fmt: skip
    results = {"header": header, "cp1": [], "sim": []}
    for mask, backend in itertools.product([] if args.no_cp1 else masks, explicit):
        results["cp1"].append(bench_cp1_overhead(args.cp1_tokens, mask, backend))
        r = results["cp1"][-1]
        print(f"# cp1 {mask} {backend.value}: raw {r['raw_ffa_ms']:.3f} ms, calc_attn {r['calc_attn_ms']:.3f} ms "
              f"({r['overhead']:+.1%})", flush=True)  # fmt: skip
    for mask in masks:
        for cp in map(int, args.cps.split(",")):
            rounds = args.rounds_dense if mask in ("full", "causal") and cp >= 32 else args.rounds
            for alg, backend in itertools.product(algs, backends):  # the algorithms of a mask side by side
                r = simulate_cp(mask, cp, args.tokens_per_gpu, args.degree, backend, rounds, args.candidates,
                                args.profile, alg)  # fmt: skip
                if not args.no_single:
                    # full/causal at cp 64 would take minutes on one GPU: past --single-max-tokens the same mask
                    # family at that size stands in (its throughput has long reached the asymptote); measured
                    # once per (mask, tokens, backend). An explicit row: its own rate; auto: the fastest one's
                    r["single_tokens"] = min(cp * args.tokens_per_gpu, args.single_max_tokens)
                    rates = [single_gpu_tflops(mask, r["single_tokens"], b) for b in explicit
                             if backend in (b, KernelBackend.AUTO)]  # fmt: skip
                    r["single_fwd"], r["single_bwd"] = (max(x) for x in zip(*rates))
                results["sim"].append(r)
                _save(args.json, results)  # row by row: a run cut short keeps what it measured
                print(f"# {mask} cp{cp} degree {args.degree} {_alg_cell(r)} {backend.value} ({r['backend']}): slowest "
                      f"rank {r['slowest_fwd_ms']:.3f} / {r['slowest_bwd_ms']:.3f} ms (ranks {r['timed_ranks']} timed "
                      f"{rounds}x), fwd {r['tflops_fwd']:.0f} bwd {r['tflops_bwd']:.0f} TFLOP/s/GPU (one GPU on the "
                      f"whole mask: {r.get('single_fwd', 0):.0f} / {r.get('single_bwd', 0):.0f})", flush=True)  # fmt: skip
    if args.scaling:
        results["scaling"] = scaling_rows(results["sim"])
    _save(args.json, results)
    print(header)
    cp1 = [[r["mask"], r["backend"], f"{r['raw_ffa_ms']:.3f}", f"{r['calc_attn_ms']:.3f}", f"{r['overhead']:+.1%}",
            f"{r['raw_fwd_bwd_ms']:.3f}", f"{r['calc_attn_fwd_bwd_ms']:.3f}", f"{r['overhead_fwd_bwd']:+.1%}"]
           for r in results["cp1"]]  # fmt: skip
    print("\n" + "\n".join(table(["mask", "backend", "raw fwd ms", "calc_attn fwd ms", "overhead",
                                   "raw fwd+bwd ms", "calc_attn fwd+bwd ms", "overhead"], cp1)))  # fmt: skip
    sim = []
    for r in results["sim"]:
        ratio = "n/a"
        if "single_fwd" in r:
            ratio = f"{r['tflops_fwd'] / r['single_fwd']:.2f}x / {r['tflops_bwd'] / r['single_bwd']:.2f}x"
        sim.append([r["mask"], r["cp"], _backend_cell(r), f"{r['imbalance']:.3f}", f"{r['slowest_fwd_ms']:.2f}",
                    f"{r['slowest_bwd_ms']:.2f}", f"{r['tflops_fwd']:.0f}", f"{r['tflops_bwd']:.0f}", ratio,
                    auto_over_fastest(r, results["sim"]), f"{r['comm_ms_nvlink']:.2f}",
                    f"{r['comm_ms_ib']:.2f}"])  # fmt: skip
    print("\n" + "\n".join(table(["mask", "cp", "kernel backend", "imbalance", "slowest fwd ms", "slowest bwd ms",
                                   "fwd TFLOP/s/GPU", "bwd TFLOP/s/GPU", "vs one GPU fwd / bwd", "auto / fastest "
                                   "explicit fwd / bwd", "comm ms @450GB/s", "comm ms @50GB/s"], sim)))  # fmt: skip
    if args.scaling:
        print_scaling(results["scaling"], args.tokens_per_gpu)
    return 0


def _save(path: str | None, results: dict) -> None:
    if path:
        write_json(path, results)


def _alg_cell(r: dict) -> str:
    """The dispatch asked for, and the algorithm of the plan where that differs (``default``: chosen)."""
    asked, got = r.get("dispatch_alg_asked", DEFAULT_ALG), r["dispatch_alg"]
    return got if asked == got else f"{asked} ({got})"


def _backend_cell(r: dict) -> str:
    """The kernel backend asked for, and what it resolved to where that differs."""
    asked = r["kernel_backend"]
    return asked if asked == r["backend"] else f"{asked} ({r['backend']})"


def print_scaling(rows_in: list[dict], tokens_per_gpu: int) -> None:
    """The scaling table (markdown): measured E, the plan's remote K/V, predicted and published TFLOP/s."""

    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    print(f"\nScaling, {tokens_per_gpu} tokens per GPU (E measured: every rank's kernels on this GPU; predicted: "
          "cost model, NVLink inside 8-GPU nodes, 50 GB/s per GPU between nodes; published: MagiAttention H100)")  # fmt: skip
    rows = []
    for r in rows_in:
        p, mean = r["predicted"], r["remote_kv_tokens_mean"]
        rows.append([r["mask"], r["cp"], _backend_cell(r), f"{r['chunk_size']} ({_alg_cell(r)})",
                     num(r.get("E_fwd"), ".2f"), num(r.get("E_bwd"), ".2f"),
                     f"{num(r.get('E_fwd_queued'), '.2f')} / {num(r.get('E_bwd_queued'), '.2f')}", num(r.get("single_tokens"), ","),
                     f"{num(r['remote_kv_tokens_max'], ',')} ({num(mean, ',.0f')})",
                     f"{num(p.get('fwd_tflops_per_gpu'), '.0f')} / {num(p.get('bwd_tflops_per_gpu'), '.0f')}",
                     f"{num(r['published_h100_fwd'], '')} / {num(r['published_h100_bwd'], '')}",
                     ",".join(map(str, r["timed_ranks"] or []))])  # fmt: skip
    print("\n" + "\n".join(table(["mask", "cp", "kernel backend", "chunk", "E fwd", "E bwd", "E queued fwd / bwd", "one-GPU tokens",
                                   "remote K/V max (mean)", "predicted fwd / bwd TFLOP/s/GPU",
                                   "published H100 fwd / bwd", "ranks timed in full"], rows)))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
