"""Planner benchmark (magi-solver, CPU only): plan times, compute balance against the lower bound, and
per-rank remote K/V tokens against ring (zigzag) and all-gather K/V.

    .venv/bin/python -m benchmarks.solver_bench                 # the table in docs/benchmarks/solver.md
    .venv/bin/python -m benchmarks.solver_bench --json out.json # also write JSON rows (git SHA, machine)

Masks (1M tokens by default, chunk 2048): varlen causal and varlen full (300 long-tailed documents, as in
`python -m magi_solver.demo`), causal sliding window of 1024 over the same documents, and block-causal
video (8 clips of 128K tokens, 4096-token blocks). Times are medians over `--repeat` runs (p10/p90 in
JSON), measured after one warm-up, mask building outside the timed region.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from magi_solver import (
    MaskSpec,
    PlanOptions,
    make_block_causal_mask,
    make_sliding_window_mask,
    make_varlen_causal_mask,
    make_varlen_full_mask,
    plan_attention,
    solve_dispatch,
)
from magi_solver.choice import clear_dispatch_cache
from magi_solver.demo import varlen_doc_lengths


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[int], MaskSpec]


def _cu(total: int) -> list[int]:
    return np.concatenate([[0], np.cumsum(varlen_doc_lengths(total, 300, seed=0))]).tolist()


CASES = [
    Case("varlen_causal", lambda n: make_varlen_causal_mask(_cu(n))),
    Case("varlen_full", lambda n: make_varlen_full_mask(_cu(n))),
    Case("swa_causal_w1024", lambda n: make_sliding_window_mask(_cu(n), (1024, 0))),
    Case("block_causal_b4096", lambda n: make_block_causal_mask(list(range(0, n + 1, n // 8)), 4096)),
]


@dataclass
class Row:
    mask: str
    cp: int
    slices: int
    dispatch_ms: float
    plan_ms: float
    plan_dynamic_ms: float
    imb_min_heap: float
    imb_affinity: float
    imb_zigzag: float
    imb_sequential: float
    lower_bound: float
    remote_max: int
    remote_mean: float
    remote_max_affinity: int
    ring: int
    all_gather: int
    dynamic_degree: int
    kernel_slices_max: int
    dispatch_ms_p10: float = 0.0
    dispatch_ms_p90: float = 0.0
    plan_ms_p10: float = 0.0
    plan_ms_p90: float = 0.0


def _timed(repeat: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[float]]:
    out = fn(*args, **kwargs)  # warm-up
    ts = []
    for _ in range(repeat):
        clear_dispatch_cache()  # time the solve, not a cache hit
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        ts.append((time.perf_counter() - t0) * 1e3)
    return out, ts


def _q(ts: list[float], p: float) -> float:
    return float(np.percentile(ts, p))


def run(total: int, cps: list[int], chunk: int, repeat: int) -> list[Row]:
    rows = []
    for case in CASES:
        q, k, t = case.build(total)
        for cp in cps:
            args = (q, k, t, total, cp, chunk)
            disp, td = _timed(repeat, solve_dispatch, *args)
            # the runtime's path with this explicit chunk size (min_heap, one remote stage)
            plan_args = (q, k, t, total, cp)
            opts = {"chunk_size": chunk}
            plan, tp = _timed(repeat, plan_attention, *plan_args, **opts, options=PlanOptions())
            dynamic = PlanOptions(overlap_degree=None)
            dyn, tdyn = _timed(1, plan_attention, *plan_args, **opts, options=dynamic)
            aff = plan_attention(*plan_args, **opts, options=PlanOptions(dispatch_alg="affinity"))
            s = plan.summary()
            rows.append(
                Row(
                    mask=case.name,
                    cp=cp,
                    slices=len(t),
                    dispatch_ms=statistics.median(td),
                    plan_ms=statistics.median(tp),
                    plan_dynamic_ms=statistics.median(tdyn),
                    imb_min_heap=disp.imbalance,
                    imb_affinity=aff.imbalance,
                    imb_zigzag=solve_dispatch(q, k, t, total, cp, chunk, alg="zigzag").imbalance,
                    imb_sequential=solve_dispatch(q, k, t, total, cp, chunk, alg="sequential").imbalance,
                    lower_bound=disp.lower_bound_imbalance,
                    remote_max=s["remote_tokens_max"],
                    remote_mean=s["remote_tokens_mean"],
                    remote_max_affinity=max(aff.remote_tokens_per_rank),
                    ring=s["ring_tokens"],
                    all_gather=s["all_gather_tokens"],
                    dynamic_degree=dyn.overlap_degree,
                    kernel_slices_max=s["num_slices_max"],
                    dispatch_ms_p10=_q(td, 10),
                    dispatch_ms_p90=_q(td, 90),
                    plan_ms_p10=_q(tp, 10),
                    plan_ms_p90=_q(tp, 90),
                )
            )
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return rows


def _k(n: float) -> str:
    return f"{n / 1024:.0f}K"


def table(rows: list[Row]) -> str:
    lines = [
        "| mask | cp | slices | dispatch ms | plan ms (dyn) | imbalance min_heap / affinity / zigzag / seq | "
        "lower bound | remote K/V max (mean) | affinity max | ring = all-gather | saved vs ring |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mask} | {r.cp} | {r.slices} | {r.dispatch_ms:.1f} | {r.plan_ms:.0f} ({r.plan_dynamic_ms:.0f}) | "
            f"{r.imb_min_heap:.3f} / {r.imb_affinity:.3f} / {r.imb_zigzag:.2f} / {r.imb_sequential:.2f} | "
            f"{r.lower_bound:.3f} | {_k(r.remote_max)} ({_k(r.remote_mean)}) | {_k(r.remote_max_affinity)} | "
            f"{_k(r.ring)} | {1 - r.remote_max / r.ring:.0%} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total", type=int, default=1 << 20)
    p.add_argument("--cp", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="write JSON rows here")
    args = p.parse_args()
    rows = run(args.total, args.cp, args.chunk, args.repeat)
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    machine = f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, numpy {np.__version__}"
    print(f"total {args.total:,} tokens, chunk {args.chunk}; git {sha}; {machine}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sha": sha, "machine": machine, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
