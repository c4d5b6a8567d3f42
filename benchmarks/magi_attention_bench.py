"""Runtime measurements on ONE GPU (issue: "Measured on one GPU").

1. cp=1 overhead: `calc_attn` (cp group of one) against a raw `flex_flash_attn_func` call on the same mask.
2. Simulated context parallelism: for cp 8/16/32/64, plan the mask, then run every rank's share of the
   work (FFA on its host slices and on each remote stage's slices, forward and backward) on this GPU in
   turn. Report the slowest rank's compute time, the compute balance, the TFLOP/s/GPU it implies when
   communication is hidden, and the time each stage's remote K/V would take on a 450 GB/s NVLink and a
   50 GB/s inter-node link (the communication overlaps compute when it is shorter than the previous stage).

    python benchmarks/magi_attention_bench.py [--tokens-per-gpu 8192] [--cps 8,16,32,64] [--out docs/...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import sys

import torch
import triton

from magi_attention.api import calc_attn, magi_attn_flex_key
from magi_ffa import ffa_bwd, ffa_fwd, flex_flash_attn_func
from magi_solver import plan_dist_attn

HQ, HKV, D = 64, 8, 128
NVLINK_BPS, IB_BPS = 450e9, 50e9


def varlen_docs(total: int, seed: int = 0) -> list[list[int]]:
    """Long-tailed document lengths, each at most a quarter of the total (same rule as the kernel bench)."""
    rng = random.Random(seed)
    bounds, start = [], 0
    while start < total:
        length = max(128, min(int(rng.lognormvariate(math.log(total / 16), 1.0)), total // 4))
        bounds.append([start, min(total, start + length)])
        start += length
    return bounds


def make_mask(name: str, total: int):
    if name == "full":
        return [[0, total]], [[0, total]], [0]
    if name == "causal":
        return [[0, total]], [[0, total]], [1]
    docs = varlen_docs(total)
    return docs, docs, [1 if name == "varlen_causal" else 0] * len(docs)


def _tensors(slices, device):
    n = len(slices.types)
    return (
        torch.tensor(slices.q_ranges, dtype=torch.int32, device=device).reshape(n, 2),
        torch.tensor(slices.k_ranges, dtype=torch.int32, device=device).reshape(n, 2),
        torch.tensor(slices.types, dtype=torch.int32, device=device).reshape(n),
    )


def bench_cp1_overhead(total: int, mask: str) -> dict:
    q_ranges, k_ranges, types = make_mask(mask, total)
    dev = torch.device("cuda")
    q = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16)
    key = magi_attn_flex_key(q_ranges, k_ranges, types, total, total, HQ, HKV, D, None)
    qr = torch.tensor(q_ranges, dtype=torch.int32, device=dev)
    kr = torch.tensor(k_ranges, dtype=torch.int32, device=dev)
    tr = torch.tensor(types, dtype=torch.int32, device=dev)
    raw = triton.testing.do_bench(lambda: flex_flash_attn_func(q, k, v, qr, kr, tr), warmup=50, rep=300)
    ours = triton.testing.do_bench(lambda: calc_attn(q, k, v, key), warmup=50, rep=300)
    return {
        "mask": mask,
        "tokens": total,
        "raw_ffa_ms": raw,
        "calc_attn_ms": ours,
        "overhead": ours / raw - 1,
    }


def _time_rank(q: torch.Tensor, do: torch.Tensor, calls: list) -> tuple[float, float]:
    """Forward and backward time (ms) of one rank's FFA calls (host stage + remote stages)."""
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    lse = torch.full(q.shape[:2], float("-inf"), device=q.device, dtype=torch.float32)

    def fwd():
        out.zero_()
        lse.fill_(float("-inf"))
        for (qr, kr, tr), kk, vv in calls:
            ffa_fwd(q, kk, vv, qr, kr, tr, out=out, lse=lse)

    fwd()
    o16 = out.to(q.dtype)

    def bwd():
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        for (qr, kr, tr), kk, vv in calls:
            ffa_bwd(do, q, kk, vv, o16, lse, qr, kr, tr, dq=dq)

    return triton.testing.do_bench(fwd, warmup=5, rep=40), triton.testing.do_bench(bwd, warmup=5, rep=40)


def simulate_cp(mask: str, cp: int, tokens_per_gpu: int, degree: int) -> dict:
    total = tokens_per_gpu * cp
    q_ranges, k_ranges, types = make_mask(mask, total)
    plan = plan_dist_attn(
        q_ranges, k_ranges, types, total, cp, 2048, overlap_degree=degree, min_chunk_size=512
    )
    dev = torch.device("cuda")
    shard = total // cp
    q = torch.randn(shard, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(shard, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(shard, HKV, D, device=dev, dtype=torch.bfloat16)
    do = torch.randn_like(q)
    max_remote = max(max((s.num_remote_tokens for s in r.stages), default=0) for r in plan.ranks)
    rk = torch.randn(max(1, max_remote), HKV, D, device=dev, dtype=torch.bfloat16)
    rv = torch.randn_like(rk)
    rows = []
    for rp in plan.ranks:
        calls = [(rp.host_slices, k, v)] + [
            (s.remote_slices, rk[: s.num_remote_tokens], rv[: s.num_remote_tokens]) for s in rp.stages
        ]
        calls = [(_tensors(sl, dev), kk, vv) for sl, kk, vv in calls if len(sl.types)]
        t_f, t_b = _time_rank(q, do, calls)
        area = rp.host_area + sum(s.area for s in rp.stages)
        comm_bytes = [s.num_remote_tokens * 2 * HKV * D * 2 for s in rp.stages]
        rows.append({"rank": rp.rank, "area": area, "fwd_ms": t_f, "bwd_ms": t_b, "stage_bytes": comm_bytes})
    total_area = sum(r["area"] for r in rows)
    flops_f = 4 * total_area * HQ * D
    worst_f = max(r["fwd_ms"] for r in rows)
    worst_b = max(r["bwd_ms"] for r in rows)
    mean_area = total_area / cp
    worst_bytes = max(sum(r["stage_bytes"]) for r in rows)
    return {
        "mask": mask,
        "cp": cp,
        "tokens_per_gpu": tokens_per_gpu,
        "degree": degree,
        "imbalance": max(r["area"] for r in rows) / mean_area,
        "slowest_fwd_ms": worst_f,
        "slowest_bwd_ms": worst_b,
        "tflops_fwd": flops_f / (worst_f * 1e-3 * cp) / 1e12,
        "tflops_bwd": 2.5 * flops_f / (worst_b * 1e-3 * cp) / 1e12,
        "comm_ms_nvlink": worst_bytes / NVLINK_BPS * 1e3,
        "comm_ms_ib": worst_bytes / IB_BPS * 1e3,
        "ranks": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    ap.add_argument("--cps", default="8,16,32,64")
    ap.add_argument("--masks", default="full,causal,varlen_full,varlen_causal")
    ap.add_argument("--degree", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    header = (
        f"{datetime.date.today()} | {props.name} | torch {torch.__version__} | triton {triton.__version__} | "
        f"heads {HQ}:{HKV}, d {D}, bf16"
    )
    results = {"header": header, "cp1": [], "sim": []}
    for mask in args.masks.split(","):
        results["cp1"].append(bench_cp1_overhead(32768, mask))
    for mask in args.masks.split(","):
        for cp in map(int, args.cps.split(",")):
            results["sim"].append(simulate_cp(mask, cp, args.tokens_per_gpu, args.degree))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(header)
    print("\n| mask | raw FFA ms | calc_attn ms | overhead |\n|---|---|---|---|")
    for r in results["cp1"]:
        print(f"| {r['mask']} | {r['raw_ffa_ms']:.3f} | {r['calc_attn_ms']:.3f} | {r['overhead']:+.1%} |")
    print(
        "\n| mask | cp | imbalance | slowest fwd ms | slowest bwd ms | fwd TFLOP/s/GPU | bwd TFLOP/s/GPU |"
        " comm ms @450GB/s | comm ms @50GB/s |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in results["sim"]:
        print(
            f"| {r['mask']} | {r['cp']} | {r['imbalance']:.3f} | {r['slowest_fwd_ms']:.2f} | {r['slowest_bwd_ms']:.2f}"
            f" | {r['tflops_fwd']:.0f} | {r['tflops_bwd']:.0f} | {r['comm_ms_nvlink']:.2f} | {r['comm_ms_ib']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
