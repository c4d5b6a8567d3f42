"""Probes of a simulated rank's kernel problem against the same mask in one call (what the scaling table's E
compares), each a change that could close the gap, timed on the GPU against the rank's call as the runtime
makes it (the merged call of the busiest ranks of the runtime's plan, 64:8 heads, d 128, bf16):

- ``fold``: the query heads of each GQA group (or ``--fold-factors`` of them) folded into the query sequence (row ``g * S + s`` holds head
  ``h * G + g`` of row ``s``, the mask repeated per ``g``): an MHA problem whose backward key columns are
  ``G`` times longer and whose dK / dV need no fp32 accumulation across heads. Copies included.
- ``aligned``: the merged call's keys in global order, each run at a buffer offset congruent to its global
  start mod 128 (touching runs stay touching): the whole mask's tiles and one key interval per row.
- ``heads``: the rank's problem and the whole mask's at other head counts (``--heads 64:8,64:64,8:8,8:1``):
  their rate ratio at each, to tell a cost of GQA's dK/dV accumulation across a group's heads (gone at
  ``64:64``) from a cost per CTA (``8:8``: the same columns, 8 times fewer CTAs) or the grid's shape.
- ``host``: one forward / backward timed alone (CUDA events around one call) against calls queued behind a
  busy GPU, and the host time per call while the GPU is busy (a call that synchronizes waits for the queue).

    python -m benchmarks.rank_problem_probes fold --backends cudnn --json fold.json
    python -m benchmarks.rank_problem_probes aligned --backends cudnn --json aligned.json
    python -m benchmarks.rank_problem_probes host --tokens 8192 --json host.json
    python -m benchmarks.rank_problem_probes heads --backends cudnn --json heads.json

``det-ncu-target`` runs the whole mask's backward default and deterministic (``device.sh det-ncu``);
``ncu-target`` runs the busiest rank's backward and the whole mask's once each for Nsight Compute (``bash
benchmarks/device.sh rank-ncu``); ``ncu-summary --csv FILE`` prints, per profiled kernel, the metrics that tell
a short-column problem from the whole mask's (time, SM activity against elapsed cycles, occupancy, waves,
memory and cache rates, the top warp stall reasons) from ``ncu --import REPORT --csv --page raw``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import re
import statistics
import time

import numpy as np
import torch

from benchmarks import common
from benchmarks.magi_attention_bench import HKV, HQ, D, _whole_mask, attn_kernel, auto_kernel, make_plan

TILE = 128


def _tables(sl) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return sl.q_ranges, sl.k_ranges, sl.types


def _rank_problem(mask: str, cp: int, tokens: int, rank_plan, plan, dev) -> tuple:
    """(q, do, k, v, tables) of one rank's merged call, random bf16 values."""
    shard = plan.dispatch.shard_seqlen
    q = torch.randn(shard, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(shard + rank_plan.num_remote_tokens, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ((sl, kk, vv),) = common.rank_kernel_calls(rank_plan, 0, k[:shard], v[:shard], k, v)
    return q, torch.randn_like(q), kk, vv, _tables(sl)


def _median_rounds(fns: dict, rounds: int) -> dict:
    """Interleaved rounds of each function (CUDA events, 3 calls a round, median of medians)."""
    t = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t[name].append(common.events_median_ms(fn, 3, 1))
    return {name: statistics.median(x) for name, x in t.items()}


# ----------------------------------------------------------------------------------------------- fold
def fold(t: torch.Tensor, hk: int, f: int | None = None) -> torch.Tensor:
    """``[S, H, ...]`` -> ``[f * S, H / f, ...]``: head ``j * f + r`` of row ``s`` to head ``j`` of row ``r * S +
    s`` (``f`` divides the group size ``G = H / hk``, default ``G``: one head per key head). A group's heads
    stay together, so folded head ``j`` still reads key head ``j // (G / f)``."""
    s, h, rest = t.shape[0], t.shape[1], t.shape[2:]
    f = h // hk if f is None else f
    return (
        t.reshape(s, h // f, f, *rest)
        .permute(2, 0, 1, *range(3, 3 + len(rest)))
        .reshape(f * s, h // f, *rest)
    )


def unfold(t: torch.Tensor, g: int) -> torch.Tensor:
    """The inverse of :func:`fold`."""
    s, hk, rest = t.shape[0] // g, t.shape[1], t.shape[2:]
    return t.reshape(g, s, hk, *rest).permute(1, 2, 0, *range(3, 3 + len(rest))).reshape(s, hk * g, *rest)


def fold_tables(qr: torch.Tensor, kr: torch.Tensor, tm: torch.Tensor, s: int, g: int) -> tuple:
    """The slices repeated per folded head ``g``, their queries shifted by ``g * s``."""
    off = (torch.arange(g, dtype=qr.dtype) * s).repeat_interleave(qr.shape[0])[:, None]
    return qr.repeat(g, 1) + off, kr.repeat(g, 1), tm.repeat(g)


def _fold_case(name, mod, q, do, k, v, tables, det: bool, rounds: int, f: int | None = None) -> dict:
    """Today's backward against the folded one (``f`` heads of each group folded, default all), with the
    copies in and out (``folded_ms``) and without them (``folded_kernel_ms``: tensors folded beforehand)."""
    hk = k.shape[1]
    f = q.shape[1] // hk if f is None else f
    out, lse = mod.ffa_fwd(q, k, v, *tables)[:2]
    folded_tables = fold_tables(*tables, q.shape[0], f)
    qf, of, dof, lsef = (fold(t, hk, f) for t in (q, out, do, lse[..., None]))
    lsef = lsef[..., 0].contiguous()

    def plain():
        return mod.ffa_bwd(do, q, k, v, out, lse, *tables, deterministic=det)[:3]

    def folded_kernel():
        return mod.ffa_bwd(dof, qf, k, v, of, lsef, *folded_tables, deterministic=det)[:3]

    def folded():
        qf_, of_, dof_ = (fold(t, hk, f) for t in (q, out, do))
        lsef_ = fold(lse[..., None], hk, f)[..., 0]
        dq, dk, dv = mod.ffa_bwd(dof_, qf_, k, v, of_, lsef_, *folded_tables, deterministic=det)[:3]
        return unfold(dq, f), dk, dv

    err = max(
        ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-6)).item()
        for a, b in zip(plain(), folded(), strict=True)
    )
    folded_kernel()
    t = _median_rounds({"plain": plain, "folded": folded, "folded_kernel": folded_kernel}, rounds)
    return {"case": name, "fold": f, "deterministic": det, "plain_ms": t["plain"], "folded_ms": t["folded"],
            "folded_kernel_ms": t["folded_kernel"], "speedup": t["plain"] / t["folded"],
            "kernel_speedup": t["plain"] / t["folded_kernel"], "rel_err": err, "keys": k.shape[0],
            "queries": q.shape[0]}  # fmt: skip


def fold_main(a) -> list[dict]:
    dev, rows = torch.device("cuda"), []
    factors = [int(x) for x in a.fold_factors.split(",")]
    for backend in a.backends.split(","):
        mod = __import__(f"magi_ffa_{backend}")
        for mask in a.masks.split(","):
            total, plan = make_plan(mask, a.cp, a.tokens, 0)
            rp = max(plan.ranks, key=lambda r: r.num_remote_tokens)
            q, do, k, v, tables = _rank_problem(mask, a.cp, a.tokens, rp, plan, dev)
            tw = min(total, 65536)  # the whole mask, as the yardstick runs it
            (qw, kw, vw, dw), wt = _whole_mask(mask, tw)
            for f in factors:
                for det in (bool(int(x)) for x in a.det.split(",")):
                    if backend == "fa4" and det:
                        continue  # FA4's deterministic backward is not what this probe asks about
                    rows.append(_fold_case(f"{backend} {mask} cp{a.cp} rank{rp.rank}", mod, q, do, k, v, tables,
                                           det, a.rounds, f))  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
                rows.append(
                    _fold_case(f"{backend} {mask} whole {tw}", mod, qw, dw, kw, vw, wt, False, a.rounds, f)
                )
                print(json.dumps(rows[-1]), flush=True)
    print(
        f"{'case':<44} {'f':>2} {'det':>3} {'plain ms':>9} {'folded ms':>9} {'kernel':>8} {'x':>6} {'kern x':>6}"
    )
    for r in rows:
        print(f"{r['case']:<44} {r['fold']:>2} {int(r['deterministic']):>3} {r['plain_ms']:>9.3f} "
              f"{r['folded_ms']:>9.3f} {r['folded_kernel_ms']:>8.3f} {r['speedup']:>6.2f} "
              f"{r['kernel_speedup']:>6.2f}")  # fmt: skip
    return rows


# -------------------------------------------------------------------------------------------- aligned
def aligned_layout(clipped, host_map, runs, kv_shard) -> tuple[list, np.ndarray]:
    """The merged call's slices with its keys in global order, each run at a buffer offset congruent to its
    global start mod TILE, and the gather index of that buffer into ``cat([own] + recv buffers)`` (-1: pad).
    Arguments: what ``magi_solver._assemble._rank_plan`` receives."""
    from magi_solver._assemble import _key_map
    from magi_solver._slicing import merge_full, slice_over

    kmap, bufs = _key_map(host_map, runs)
    stage_off = np.cumsum([kv_shard, *bufs])
    layout, sources, pos, prev = [], [], 0, None
    for s, e, dest, base in kmap:
        start = pos if prev == s else pos + (s - pos) % TILE
        layout.append((s, e, 0, start))
        sources.append((base if dest < 0 else int(stage_off[dest]) + base, start, e - s))
        pos, prev = start + e - s, e
    out: list[list] = [[], []]
    slice_over(clipped, layout, out)
    index = np.full(pos, -1, dtype=np.int64)
    for src, dst, n in sources:
        index[dst : dst + n] = np.arange(src, src + n)
    return merge_full(out[0]), index


def capture_plan(mask: str, cp: int, tokens: int):
    """The runtime's plan, with each rank's ``_rank_plan`` arguments kept (for :func:`aligned_layout`)."""
    import magi_solver._assemble as planner

    captured, original = {}, planner._rank_plan

    def keep(dispatch, rank, clipped, host_map, host_area, runs, casts, kv_shard):
        captured[rank] = (clipped, host_map, runs, kv_shard)
        return original(dispatch, rank, clipped, host_map, host_area, runs, casts, kv_shard)

    planner._rank_plan = keep
    try:
        total, plan = make_plan(mask, cp, tokens, 0)
    finally:
        planner._rank_plan = original
    return total, plan, captured


def aligned_main(a) -> list[dict]:
    dev, rows = torch.device("cuda"), []
    for backend in a.backends.split(","):
        mod = __import__(f"magi_ffa_{backend}")
        for mask in a.masks.split(","):
            _, plan, captured = capture_plan(mask, a.cp, a.tokens)
            for rp in sorted(plan.ranks, key=lambda r: -r.num_remote_tokens)[:2]:
                q, do, k, v, tables = _rank_problem(mask, a.cp, a.tokens, rp, plan, dev)
                sl, index = aligned_layout(*captured[rp.rank])
                idx = torch.as_tensor(index, device=dev).clamp_min(0)  # pads read key 0: no slice sees them
                at = (torch.tensor([s[0:2] for s in sl], dtype=torch.int32).reshape(-1, 2),
                      torch.tensor([s[2:4] for s in sl], dtype=torch.int32).reshape(-1, 2),
                      torch.tensor([s[4] for s in sl], dtype=torch.int32))  # fmt: skip
                fns, outs = {}, {}
                for name, (kk, vv, tt) in {"merged": (k, v, tables), "aligned": (k[idx], v[idx], at)}.items():
                    out, lse = outs[name] = mod.ffa_fwd(q, kk, vv, *tt)[:2]
                    fns[f"{name}_fwd"] = functools.partial(mod.ffa_fwd, q, kk, vv, *tt)
                    fns[f"{name}_bwd"] = functools.partial(mod.ffa_bwd, do, q, kk, vv, out, lse, *tt)
                rows.append({
                    "case": f"{backend} {mask} cp{a.cp} rank{rp.rank}", "keys_merged": k.shape[0],
                    "keys_aligned": len(index), "slices_merged": len(tables[2]), "slices_aligned": len(sl),
                    "out_diff": (outs["merged"][0].float() - outs["aligned"][0].float()).abs().max().item(),
                    **_median_rounds(fns, a.rounds),
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    print(f"{'case':<40} {'fwd merged':>10} {'aligned':>8} {'bwd merged':>10} {'aligned':>8} {'slices':>11}")
    for r in rows:
        print(f"{r['case']:<40} {r['merged_fwd']:>10.3f} {r['aligned_fwd']:>8.3f} {r['merged_bwd']:>10.3f} "
              f"{r['aligned_bwd']:>8.3f} {r['slices_merged']:>5}/{r['slices_aligned']:<5}")  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------- host
def _queued_ms(fn, reps: int = 10) -> float:
    """GPU ms per call of ``reps`` calls queued behind a busy GPU (the host runs ahead unless a call waits)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def _host_ms(fn, reps: int = 10) -> float:
    """Host ms per call while the GPU is busy for ~0.1 s: a call that synchronizes absorbs that wait."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    return elapsed


def host_main(a) -> list[dict]:
    from benchmarks.magi_attention_bench import _rank_step
    from magi_attention.config import KernelBackend

    dev, rows = torch.device("cuda"), []
    for mask in a.masks.split(","):
        total, plan = make_plan(mask, a.cp, a.tokens, 0)
        auto = a.backends == "auto"
        kern = auto_kernel(mask, total, plan) if auto else attn_kernel(KernelBackend(a.backends))
        rp = max(plan.ranks, key=lambda r: r.num_remote_tokens)
        shard = plan.dispatch.shard_seqlen
        q = torch.randn(shard, HQ, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(shard + rp.num_remote_tokens, HKV, D, device=dev, dtype=torch.bfloat16)
        v, do = torch.randn_like(k), torch.randn_like(q)
        calls = common.rank_kernel_calls(rp, 0, k[:shard], v[:shard], k, v)
        (sl, kk, vv), tables = calls[0], _tables(calls[0][0])
        out, lse = kern.fwd_slices(q, kk, vv, sl)
        p = functools.partial
        entries = {  # the runtime's entry (slices checked once) and the functional one on host tables
            "slices": (p(kern.fwd_slices, q, kk, vv, sl), p(kern.bwd_slices, do, q, kk, vv, out, lse, sl)),
            "tables": (p(kern.fwd, q, kk, vv, *tables), p(kern.bwd, do, q, kk, vv, out, lse, *tables)),
        }
        for _ in range(3):
            _rank_step(q, do, calls, kern)
        once = [_rank_step(q, do, calls, kern) for _ in range(5)]
        row = {"mask": mask, "cp": a.cp, "tokens_per_gpu": a.tokens, "rank": rp.rank,
               "once_fwd_ms": statistics.median(x[0] for x in once),
               "once_bwd_ms": statistics.median(x[1] for x in once)}  # fmt: skip
        for name, (fwd, bwd) in entries.items():
            row[f"{name}_queued_fwd_ms"] = statistics.median(_queued_ms(fwd) for _ in range(3))
            row[f"{name}_queued_bwd_ms"] = statistics.median(_queued_ms(bwd) for _ in range(3))
            row[f"{name}_host_fwd_ms"] = statistics.median(_host_ms(fwd) for _ in range(3))
            row[f"{name}_host_bwd_ms"] = statistics.median(_host_ms(bwd) for _ in range(3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'mask':<20} {'tokens':>6} {'once f/b':>14} {'queued f/b':>14} {'host f/b (slices)':>18} "
          f"{'host f/b (tables)':>18}")  # fmt: skip
    for r in rows:
        print(f"{r['mask']:<20} {r['tokens_per_gpu']:>6} {r['once_fwd_ms']:>6.2f}/{r['once_bwd_ms']:<7.2f} "
              f"{r['slices_queued_fwd_ms']:>6.2f}/{r['slices_queued_bwd_ms']:<7.2f} "
              f"{r['slices_host_fwd_ms']:>8.2f}/{r['slices_host_bwd_ms']:<9.2f} "
              f"{r['tables_host_fwd_ms']:>8.2f}/{r['tables_host_bwd_ms']:<9.2f}")  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------- heads
def _with_heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """``t`` ``[S, H, D]`` with ``h`` heads of random values (same tokens, dtype, device)."""
    return torch.randn(t.shape[0], h, *t.shape[2:], device=t.device, dtype=t.dtype)


def heads_main(a) -> list[dict]:
    """Backward (and forward) rate of the busiest rank's merged call against the whole mask's (at most 64k
    tokens) at each ``--heads`` shape; rates in TFLOP/s (the slices' area), interleaved rounds."""
    dev, rows = torch.device("cuda"), []
    for backend in a.backends.split(","):
        mod = __import__(f"magi_ffa_{backend}")
        for mask in a.masks.split(","):
            total, plan = make_plan(mask, a.cp, a.tokens, 0)
            rp = max(plan.ranks, key=lambda r: r.num_remote_tokens)
            q0, _, k0, _, tables = _rank_problem(mask, a.cp, a.tokens, rp, plan, dev)
            (qw0, kw0, _, _), wt = _whole_mask(mask, min(total, 65536))
            problems = {"rank": (q0, k0, tables), "whole": (qw0, kw0, wt)}
            for shape in a.heads.split(","):
                hq, hk = (int(x) for x in shape.split(":"))
                fns, area = {}, {}
                for name, (qq, kk, tt) in problems.items():
                    q, do, k, v = (
                        _with_heads(qq, hq),
                        _with_heads(qq, hq),
                        _with_heads(kk, hk),
                        _with_heads(kk, hk),
                    )
                    out, lse = mod.ffa_fwd(q, k, v, *tt)[:2]
                    fns[f"{name}_fwd"] = functools.partial(mod.ffa_fwd, q, k, v, *tt)
                    fns[f"{name}_bwd"] = functools.partial(mod.ffa_bwd, do, q, k, v, out, lse, *tt)
                    area[name] = common.mask_area(*(x.tolist() for x in tt))
                for fn in fns.values():  # launch data built before the rounds
                    fn()
                t = _median_rounds(fns, a.rounds)
                row = {"backend": backend, "mask": mask, "cp": a.cp, "rank": rp.rank, "heads": shape,
                       "rank_keys": k0.shape[0], "whole_tokens": qw0.shape[0], **{f"{n}_ms": x for n, x in t.items()}}  # fmt: skip
                for name in problems:
                    for step, factor in (("fwd", 1.0), ("bwd", 2.5)):
                        flops = factor * 4.0 * area[name] * hq * q0.shape[2]
                        row[f"{name}_{step}_tflops"] = flops / (t[f"{name}_{step}"] * 1e9)
                for step in ("fwd", "bwd"):
                    row[f"rate_ratio_{step}"] = row[f"rank_{step}_tflops"] / row[f"whole_{step}_tflops"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(
        f"{'case':<36} {'heads':>6} {'rank fwd/bwd TF/s':>18} {'whole fwd/bwd TF/s':>19} {'ratio fwd/bwd':>14}"
    )
    for r in rows:
        print(f"{r['backend'] + ' ' + r['mask']:<36} {r['heads']:>6} "
              f"{r['rank_fwd_tflops']:>8.0f}/{r['rank_bwd_tflops']:<9.0f} {r['whole_fwd_tflops']:>9.0f}/"
              f"{r['whole_bwd_tflops']:<9.0f} {r['rate_ratio_fwd']:>6.2f}/{r['rate_ratio_bwd']:<7.2f}")  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------- ncu target
def _profile_once(steps: dict) -> None:
    """Each step twice as warm-up (compiles, launch data), then once each in its NVTX range between
    ``cudaProfilerStart`` / ``Stop``: what ``ncu --profile-from-start off`` profiles."""
    for step in (*steps.values(), *steps.values()):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, step in steps.items():
        with torch.cuda.nvtx.range(label):
            step()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def ncu_target_main(a) -> list[dict]:
    """The busiest rank's backward and the whole mask's (``min(cp x tokens, 64k)`` tokens), each once
    between ``cudaProfilerStart`` / ``Stop`` in NVTX ranges ``rank`` and ``whole``, after two warm-up runs:
    what ``ncu --profile-from-start off --nvtx`` profiles (``bash benchmarks/device.sh rank-ncu``)."""
    from magi_attention.config import KernelBackend

    dev, rows = torch.device("cuda"), []
    for mask in a.masks.split(","):
        total, plan = make_plan(mask, a.cp, a.tokens, 0)
        auto = a.backends == "auto"
        kern = auto_kernel(mask, total, plan) if auto else attn_kernel(KernelBackend(a.backends))
        rp = max(plan.ranks, key=lambda r: r.num_remote_tokens)
        q, do, k, v, tables = _rank_problem(mask, a.cp, a.tokens, rp, plan, dev)
        (qw, kw, vw, dw), wt = _whole_mask(mask, min(total, 65536))
        problems = {"rank": (q, do, k, v, common.kernel_slices(*tables)),
                    "whole": (qw, dw, kw, vw, common.kernel_slices(*wt))}  # fmt: skip
        steps = {}
        for name, (qq, dd, kk, vv, sl) in problems.items():
            out, lse = kern.fwd_slices(qq, kk, vv, sl)
            steps[name] = functools.partial(kern.bwd_slices, dd, qq, kk, vv, out, lse, sl)
        _profile_once({f"{mask} {name}": step for name, step in steps.items()})
        rows.append({"mask": mask, "cp": a.cp, "tokens_per_gpu": a.tokens, "rank": rp.rank,
                     "rank_keys": k.shape[0], "whole_tokens": qw.shape[0]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def det_ncu_target_main(a) -> list[dict]:
    """The whole mask's backward (``--tokens`` tokens, one call) default and deterministic, once each between
    ``cudaProfilerStart`` / ``Stop`` after two warm-up runs: where the deterministic backward's extra time goes
    (``bash benchmarks/device.sh det-ncu``)."""
    rows = []
    for backend in a.backends.split(","):
        mod = __import__(f"magi_ffa_{backend}")
        for mask in a.masks.split(","):
            (q, k, v, do), tables = _whole_mask(mask, a.tokens)
            out, lse = mod.ffa_fwd(q, k, v, *tables)[:2]
            steps = {det: functools.partial(mod.ffa_bwd, do, q, k, v, out, lse, *tables, deterministic=det)
                     for det in (False, True)}  # fmt: skip
            _profile_once({f"{mask} deterministic={det}": step for det, step in steps.items()})
            rows.append({"backend": backend, "mask": mask, "tokens": a.tokens})
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ------------------------------------------------------------------------------------------- ncu summary
NCU_COLUMNS = {  # raw metric -> short name, in print order
    "gpu__time_duration.sum": "time",
    "launch__grid_size": "grid",
    "launch__waves_per_multiprocessor": "waves",
    "launch__registers_per_thread": "regs",
    "sm__cycles_active.avg": "sm_active",
    "sm__cycles_elapsed.avg": "sm_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_%",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem_%",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_%",
    "lts__t_sector_hit_rate.pct": "l2_hit_%",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_%",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_%",
}
_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def ncu_summary(rows: list[dict[str, str]], top_stalls: int = 5) -> list[dict]:
    """One dict per profiled kernel of an ``ncu --csv --page raw`` export (its rows as dicts, the units row
    left out): the kernel's id and name, the ``NCU_COLUMNS`` metrics present (as numbers), ``sm_busy`` (SM
    active cycles over elapsed: below 1 the SMs idled, e.g. in a tail) and the ``top_stalls`` largest warp
    stall reasons (warps stalled per issued instruction)."""
    out = []
    for row in rows:
        kernel = {"id": row.get("ID"), "kernel": (row.get("Kernel Name") or "")[:60]}
        for metric, short in NCU_COLUMNS.items():
            if metric in row and (x := _number(row[metric])) is not None:
                kernel[short] = x
        if kernel.get("sm_elapsed"):
            kernel["sm_busy"] = round(kernel.get("sm_active", 0.0) / kernel["sm_elapsed"], 3)
        stalls = [(m.group(1), _number(v)) for k, v in row.items() if (m := _STALL.match(k))]
        stalls = sorted(((n, x) for n, x in stalls if x is not None), key=lambda t: -t[1])
        kernel["stalls"] = {n: round(x, 3) for n, x in stalls[:top_stalls]}
        out.append(kernel)
    return out


def ncu_summary_main(a) -> list[dict]:
    with open(a.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    kernels = ncu_summary(rows[1:] if rows and not (rows[0].get("ID") or "").strip().isdigit() else rows)
    for k in kernels:
        print(json.dumps(k), flush=True)
    return kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "probe",
        choices=("fold", "aligned", "host", "heads", "ncu-target", "det-ncu-target", "ncu-summary"),
    )
    ap.add_argument("--masks", default="varlen_causal,video_block_causal,varlen_full,causal")
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU")
    ap.add_argument(
        "--backends", default="cudnn", help="fold, aligned: kernel packages; host: a backend or auto"
    )
    ap.add_argument("--det", default="0,1", help="fold: deterministic backward off / on")
    ap.add_argument("--fold-factors", default="8", help="fold: heads of each group folded (divisors of it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", default="64:8,64:64,8:8,8:1", help="heads: query:key head counts to compare")
    ap.add_argument("--json", default=None)
    ap.add_argument("--csv", default=None, help="ncu-summary: an `ncu --import R --csv --page raw` export")
    a = ap.parse_args()
    probes = {"fold": fold_main, "aligned": aligned_main, "host": host_main, "heads": heads_main, "ncu-target": ncu_target_main,
              "det-ncu-target": det_ncu_target_main,
              "ncu-summary": ncu_summary_main}  # fmt: skip
    rows = probes[a.probe](a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": common.environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
