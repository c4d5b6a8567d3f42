"""The planner's targets on the CPU: the default planner (placement chosen per mask) and the chunk dispatch.

What it measures and how to run it: docs/benchmarks/cases.md (plan-targets).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

from benchmarks.cli import write_json
from benchmarks.common import make_mask
from magi_solver import OverlapCostModel, PlanOptions, default_chunk_size, get_profile, plan_attention
from magi_solver.bounds import balance_bound, efficiency_bound
from magi_solver.choice import clear_dispatch_cache
from magi_solver.cli import main as plan_cli
from magi_solver.kernel_law import get_kernel_law, law_for_mask
from magi_solver.mask import normalize_mask
from magi_solver.pricing import price_plan

TARGET = {8192: 1.03, 2048: 1.05}
REMOTE_TARGET = 1.25
TIME_TARGET = 1.05
DEFAULT_REMOTE_TARGET = 1.1
PLAN_TIME_TARGET_S = 1.0
DEFAULT_MASKS = "varlen_causal,varlen_full,video_block_causal,full,causal"
NEW_MASKS = "docs4k_causal,docs4k_full,short_docs_causal,docs4k_window2048,video_clips"
"""The mask families defined in tokens (`benchmarks.common.make_mask` builds every mask here)."""


def _slices_file(q, k, t, total: int, path: str) -> None:
    data = {"q_ranges": [list(r) for r in q], "k_ranges": [list(r) for r in k], "types": [int(x) for x in t]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**data, "total_seqlen": total}, f)


def _cli_record(path: str, cp: int) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = plan_cli(["--slices", path, "--cp", str(cp), "--json", "--quiet"])
    if rc:
        raise RuntimeError(f"magi-attention-plan exited with {rc}")
    (rec,) = json.loads(out.getvalue())  # stdout holds the JSON and nothing else
    return rec


def _baseline_remote(q, k, t, total: int, cp: int) -> tuple[int, int]:
    """(chunk, busiest rank's remote K/V) of the fixed rule: chunk `min(2048, ceil(total / (8 cp)))`,
    min_heap."""
    chunk = default_chunk_size(total, cp)
    plan = plan_attention(q, k, t, total, cp, chunk_size=chunk, options=PlanOptions(overlap_degree=0))
    return chunk, max(plan.remote_tokens_per_rank)


def _plan_seconds(q, k, t, total: int, cp: int, repeat: int) -> float:
    """Best-of-`repeat` seconds of the runtime's plan (dispatch choice included, cache cleared)."""
    model = OverlapCostModel(get_profile("h200", "fa4"), 64, 8, 128, law=get_kernel_law("h200", "cudnn"))
    options = PlanOptions(dispatch_alg=None, overlap_degree=None, dynamic_max_degree=4, cost_model=model)
    best = float("inf")
    for _ in range(repeat):
        clear_dispatch_cache()
        t0 = time.perf_counter()
        plan_attention(q, k, t, total, cp, options=options)
        best = min(best, time.perf_counter() - t0)
    return best


def _default_row(name: str, tpg: int, cp: int, q, k, t, path: str) -> dict:
    """The default planner's record against the chunk dispatch (affinity, chunk size chosen)."""
    total = tpg * cp
    rec = _cli_record(path, cp)
    chunked = plan_attention(
        q, k, t, total, cp, options=PlanOptions(dispatch_alg="affinity", overlap_degree=0)
    )
    base = max(max(chunked.remote_tokens_per_rank), 1)
    step = rec["schemes"]["magi"]["fwd_ms"] + rec["schemes"]["magi"]["bwd_ms"]
    return {
        "mask": name,
        "tokens_per_gpu": tpg,
        "cp": cp,
        "dispatch_alg": rec["dispatch_alg"],
        "chunk_size": rec["chunk_size"],
        "time_imbalance": rec["time_imbalance"],
        "imbalance": rec["imbalance"],
        "remote_kv_tokens_max": rec["remote_kv_tokens_max"],
        "recv_buffer_bytes_max": rec["recv_buffer_bytes_max"],
        "chunk_dispatch_remote_kv_tokens_max": base,
        "remote_ratio": rec["remote_kv_tokens_max"] / base,
        "recv_buffer_ratio": rec["recv_buffer_bytes_max"] / (base * rec["kv_bytes_per_token"]),
        "predicted_step_ms": step,
        "predicted_fwd_ms": max(rec["rank_fwd_ms"]),
        "predicted_bwd_ms": max(rec["rank_bwd_ms"]),
        "plan_seconds": rec["plan_seconds"],
        "plan_fraction_of_step": rec["plan_seconds"] * 1e3 / step if step else 0.0,
    }


def _chunked_row(name: str, tpg: int, cp: int, q, k, t) -> dict:
    """The chunk dispatch asked for by name: area balance and remote K/V against the fixed rule."""
    total = tpg * cp
    plan = plan_attention(q, k, t, total, cp, options=PlanOptions(dispatch_alg="affinity", overlap_degree=0))
    base_chunk, base_remote = _baseline_remote(q, k, t, total, cp)
    remote = max(plan.remote_tokens_per_rank)
    return {
        "mask": name,
        "tokens_per_gpu": tpg,
        "cp": cp,
        "chunk_size": plan.dispatch.chunk_size,
        "imbalance": plan.imbalance,
        "lower_bound_imbalance": plan.dispatch.lower_bound_imbalance,
        "remote_kv_tokens_max": remote,
        "baseline_chunk_size": base_chunk,
        "baseline_remote_kv_tokens_max": base_remote,
        "remote_ratio": remote / base_remote if base_remote else 1.0,
    }


def bounds_rows(names: list[str], rows: list[tuple[int, int]]) -> list[dict]:
    """The law's best E for each mask and (tokens per GPU, cp), beside the law's E of the default
    planner's plan (the whole mask's law time over cp times the slowest rank's), that plan's E were its
    ranks balanced (the mean rank instead of the slowest: what its received keys alone allow), and the keys
    all ranks receive under the bound's cuts and under the plan."""
    out = []
    for name in names:
        for tpg, cp in rows:
            total = tpg * cp
            q, k, t = make_mask(name, total)
            sl = normalize_mask(q, k, t, total, total)
            law = law_for_mask(sl, total)
            b = efficiency_bound(sl, total, cp, law)
            plan = plan_attention(
                q, k, t, total, cp, options=PlanOptions(dispatch_alg=None, overlap_degree=0)
            )
            price = price_plan(plan.dispatch, sl, law)
            out.append({"mask": name, "tokens_per_gpu": tpg, "cp": cp, "law": law.backend, "E_fwd": b.fwd,
                        "E_bwd": b.bwd, "extra_keys": b.extra_keys, "cut_units": b.cut_units,
                        "plan_alg": plan.dispatch.alg.value, "E_fwd_capacity": b.fwd_capacity,
                        "plan_E_fwd": b.whole_fwd_ms / (cp * float(price.fwd_ms.max())),
                        "plan_E_bwd": b.whole_bwd_ms / (cp * float(price.bwd_ms.max())),
                        "plan_balanced_E_fwd": b.whole_fwd_ms / (cp * float(price.fwd_ms.mean())),
                        "plan_balanced_E_bwd": b.whole_bwd_ms / (cp * float(price.bwd_ms.mean())),
                        "plan_received_keys": int(price.remote.sum()), "E_bwd_capacity": b.bwd_capacity,
                        "plan_time_imbalance": price.time_imbalance,
                        "plan_keys_imbalance_bound": balance_bound(plan.dispatch, price, law)
                        / float(price.fwd_ms.mean() + price.bwd_ms.mean())})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cps", default="8,16,32,64")
    ap.add_argument("--tokens-per-gpu", default="8192,2048")
    ap.add_argument("--masks", default=None, help=f"default: {DEFAULT_MASKS},{NEW_MASKS}")
    ap.add_argument("--plan-time-tokens", type=int, default=1 << 20)
    ap.add_argument("--plan-time-cp", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bounds", action="store_true", help="only the bounds table (8k: cp 8-64, 2k: cp 8, 32)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    names = (args.masks or f"{DEFAULT_MASKS},{NEW_MASKS}").split(",")
    if args.bounds:
        grid = [(8192, c) for c in (8, 16, 32, 64)] + [(2048, c) for c in (8, 32)]
        rows = bounds_rows(names, grid)
        print("| mask | tok/GPU | cp | law | E bound fwd / bwd (capacity) | received keys | cut units | plan | plan E fwd / "
              "bwd | balanced plan E fwd / bwd | plan received keys | plan time imbal. | its keys allow |\n"
              "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")  # fmt: skip
        for r in rows:
            print(f"| {r['mask']} | {r['tokens_per_gpu']} | {r['cp']} | {r['law']} | {r['E_fwd']:.3f} / "
                  f"{r['E_bwd']:.3f} ({r['E_fwd_capacity']:.3f} / {r['E_bwd_capacity']:.3f}) | "
                  f"{r['extra_keys']:,} | {r['cut_units']} | {r['plan_alg']} | "
                  f"{r['plan_E_fwd']:.3f} / {r['plan_E_bwd']:.3f} | {r['plan_balanced_E_fwd']:.3f} / "
                  f"{r['plan_balanced_E_bwd']:.3f} | {r['plan_received_keys']:,} | "
                  f"{r['plan_time_imbalance']:.3f} | {r['plan_keys_imbalance_bound']:.3f} |", flush=True)  # fmt: skip
        if args.json:
            write_json(args.json, {"bounds": rows})
        return 0
    cps = [int(x) for x in args.cps.split(",")]
    tpgs = [int(x) for x in args.tokens_per_gpu.split(",")]
    defaults, chunked, misses = [], [], []
    print("Default planner (no chunk size, no algorithm):")
    print()
    print("| mask | tok/GPU | cp | placement | chunk | time imbal. | remote K/V max | ratio | recv buf ratio "
          "| step ms | plan s | plan/step |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for tpg in tpgs:
                for cp in cps:
                    total = tpg * cp
                    q, k, t = make_mask(name, total)
                    path = os.path.join(tmp, f"{name}_{total}.json")
                    _slices_file(q, k, t, total, path)
                    r = _default_row(name, tpg, cp, q, k, t, path)
                    defaults.append(r)
                    if r["time_imbalance"] > TIME_TARGET or r["remote_ratio"] > DEFAULT_REMOTE_TARGET:
                        misses.append(f"default {name} {tpg}/GPU cp {cp}")
                    print(f"| {name} | {tpg} | {cp} | {r['dispatch_alg']} | {r['chunk_size']} | "
                          f"{r['time_imbalance']:.3f} | {r['remote_kv_tokens_max']:,} | {r['remote_ratio']:.2f} | "
                          f"{r['recv_buffer_ratio']:.2f} | {r['predicted_step_ms']:.2f} | {r['plan_seconds']:.3f} | "
                          f"{r['plan_fraction_of_step']:.1f} |", flush=True)  # fmt: skip
    print()
    print('Chunk dispatch asked for by name (alg="affinity", chunk size chosen):')
    print()
    print("| mask | tok/GPU | cp | chunk | imbalance | lower bound | remote K/V max | ratio vs fixed rule |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in names:
        for tpg in tpgs:
            for cp in cps:
                q, k, t = make_mask(name, tpg * cp)
                r = _chunked_row(name, tpg, cp, q, k, t)
                chunked.append(r)
                if r["imbalance"] > TARGET.get(tpg, 1.05) or r["remote_ratio"] > REMOTE_TARGET:
                    misses.append(f"chunk dispatch {name} {tpg}/GPU cp {cp}")
                print(f"| {name} | {tpg} | {cp} | {r['chunk_size']} | {r['imbalance']:.3f} | "
                      f"{r['lower_bound_imbalance']:.3f} | {r['remote_kv_tokens_max']:,} | {r['remote_ratio']:.2f} "
                      f"(chunk {r['baseline_chunk_size']}: {r['baseline_remote_kv_tokens_max']:,}) |", flush=True)  # fmt: skip
    print()
    n, cp = args.plan_time_tokens, args.plan_time_cp
    print(f"Plan time, {n:,} tokens, cp {cp} (key normalisation + runtime plan, best of {args.repeat}):")
    print()
    print("| mask | slices | seconds | target |")
    print("|---|---:|---:|---:|")
    timing = []
    for name in names:
        q, k, t = make_mask(name, n)
        s = _plan_seconds(q, k, t, n, cp, args.repeat)
        timing.append({"mask": name, "tokens": n, "cp": cp, "seconds": s})
        if s > PLAN_TIME_TARGET_S:
            misses.append(f"plan time {name}")
        print(f"| {name} | {len(t)} | {s:.2f} | {PLAN_TIME_TARGET_S:.0f} |", flush=True)
    print()
    print("misses: " + (", ".join(misses) if misses else "none"))
    if args.json:
        write_json(args.json, {"default": defaults, "chunk_dispatch": chunked, "plan_time": timing,
                               "misses": misses})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
