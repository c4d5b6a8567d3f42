"""How low can a placement's slowest ranks go? Simulated annealing over single-chunk swaps, priced by the law.

A check of the documents placement (`documents`), not a part of it: it prices hundreds of thousands of swaps
where the placement prices a few thousand, so it runs for minutes, not milliseconds. It answers one question
about an assignment: is its kernel metric `max fwd + max bwd` (the ranks' predicted kernel times, `kernel_law`)
as low as a much wider search reaches, or does the placement leave time on the table?

The walk swaps one chunk of one rank for one chunk of another (every rank keeps its chunk count), any chunk,
with no limit on cuts: the first rank is the slowest forward or backward rank half the time, else any rank;
the second any other. A swap that does not raise the metric is made; a worse one with probability
`exp(-rise / T)`, the temperature `T` falling linearly from `temperature` times the start's `mean fwd + mean
bwd` to 0. Each swap reprices its two ranks exactly (their area, rows and the union of the keys their rows
need, `documents_repair._State`), so every metric here is the placement's own.

Two figures come out: the least metric the walk met (where it is the start's, no swap sequence it tried beat
the placement), and the least `time_imbalance` it met with the metric there. The ratio falls as well when
the ranks' mean rises (more received keys on the fast ranks) with the slowest rank unchanged or slower,
which is why both are reported.

Run: ``python -m magi_solver.tools.anneal --mask docs4k_full --tokens-per-gpu 2048 --cp 16`` (one core;
about 6 us per swap tried at 16 ranks, 0.2 ms at 64 ranks of 1,024 chunks).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass

import numpy as np

from ..builders import FAMILY_MASKS, make_family_mask
from ..dispatch import DispatchPlan
from ..documents import documents_plans
from ..documents_repair import ChunkTables, _State
from ..documents_units import _chunk_tables, _Costs, find_units
from ..kernel_law import KernelLaw, law_for_mask
from ..pricing import NODE

__all__ = ["AnnealResult", "anneal", "family_placement", "main", "placement_tables"]

_STARTS = ("plan", "contiguous")
"""`--start`: the documents placement's assignment, or rank r holding the r-th equal run of chunks."""


@dataclass(frozen=True, slots=True)
class AnnealResult:
    """What one walk found (ms: predicted kernel time by the law).

    Attributes:
        start_metric_ms: `max fwd + max bwd` of the assignment the walk started from.
        start_time_imbalance: its `time_imbalance` (the metric over `mean fwd + mean bwd`).
        best_metric_ms: the least metric met.
        best_time_imbalance: the time imbalance there.
        least_time_imbalance: the least time imbalance met.
        least_time_imbalance_metric_ms: the metric there.
        swaps: swaps tried; accepted: swaps made.
        best_owner: int64 `[n]`, the assignment of the least metric.
    """

    start_metric_ms: float
    start_time_imbalance: float
    best_metric_ms: float
    best_time_imbalance: float
    least_time_imbalance: float
    least_time_imbalance_metric_ms: float
    swaps: int
    accepted: int
    best_owner: np.ndarray


def placement_tables(
    slices: list[tuple[int, int, int, int, int]], total: int, cp: int, law: KernelLaw, chunk_size: int
) -> ChunkTables:
    """The tables the documents placement prices an assignment of `total / chunk_size` chunks with (`total`
    a multiple of `chunk_size`): per chunk its area and key interval (own tokens included), the units."""
    n = total // chunk_size
    area, klo, khi, _ = _chunk_tables(slices, n, chunk_size)
    units = find_units(slices, _Costs(area, klo, khi, chunk_size, law), n)
    at = np.arange(n, dtype=np.int64) * chunk_size
    lo, hi = np.minimum(klo, at), np.maximum(khi, at + chunk_size)
    return ChunkTables(area, lo, hi, units, chunk_size, cp, law, NODE)


def family_placement(
    name: str, total: int, cp: int, seed: int = 0
) -> tuple[DispatchPlan, ChunkTables, np.ndarray]:
    """The documents placement of mask family `name` (`FAMILY_MASKS`, documents of `seed`) over `total` tokens
    at `cp` ranks, priced by the law `auto` would pick: `(plan, its tables, int64 [n] owner of each chunk)`."""
    spec = make_family_mask(name, total, seed)
    sl = [
        (*q, *k, t.code) for q, k, t in zip(spec.q_ranges.to_tuples(), spec.k_ranges.to_tuples(), spec.types)
    ]
    law = law_for_mask(sl, total)
    plan = documents_plans(sl, total, cp, law)[0]
    owner = np.empty(plan.num_chunks, dtype=np.int64)
    for r, part in enumerate(plan.partitions):
        owner[list(part)] = r
    return plan, placement_tables(sl, plan.total_seqlen, cp, law, plan.chunk_size), owner


def anneal(
    owner: np.ndarray, tables: ChunkTables, *, swaps: int = 200_000, temperature: float = 0.003, seed: int = 0
) -> AnnealResult:
    """Anneal from `owner` (int64 `[n]`, each chunk's rank; left unchanged): see the module docstring.

    Raises ValueError for `swaps` < 1, a negative `temperature` or an `owner` of the wrong length."""
    if isinstance(swaps, bool) or not isinstance(swaps, int) or swaps < 1:
        raise ValueError(f"`swaps` must be an int >= 1, got {swaps!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"`temperature` must be a number >= 0, got {temperature!r}")
    owner = np.asarray(owner, dtype=np.int64)
    if owner.shape != tables.area.shape:
        raise ValueError(
            f"`owner` must have one rank per chunk ({tables.area.size}), got shape {owner.shape}"
        )
    cp = tables.cp
    st = _State(owner.copy(), tables)
    f, b = st.fwd, st.bwd
    members = [list((st.owner == r).nonzero()[0]) for r in range(cp)]

    def imbalance() -> float:
        mean = float(f.mean() + b.mean())
        return float(f.max() + b.max()) / mean if mean > 0 else 1.0

    cur = float(f.max() + b.max())
    start, start_ratio = cur, imbalance()
    best, best_ratio, best_owner = cur, start_ratio, st.owner.copy()
    least, least_metric = start_ratio, cur
    t0 = temperature * float(f.mean() + b.mean())
    rng = random.Random(seed)
    accepted = 0
    for it in range(swaps):
        heat = t0 * (1.0 - it / swaps)
        if rng.random() < 0.5:
            s = int(np.argmax(f)) if rng.random() < 0.5 else int(np.argmax(b))
        else:
            s = rng.randrange(cp)
        t = rng.randrange(cp - 1)
        t += t >= s
        if not members[s] or not members[t]:
            continue
        i, j = rng.randrange(len(members[s])), rng.randrange(len(members[t]))
        x, y = members[s][i], members[t][j]
        was = (f[s], b[s], f[t], b[t])
        st.owner[x], st.owner[y] = t, s
        f[s], b[s], _ = st.kernel(s)
        f[t], b[t], _ = st.kernel(t)
        new = float(f.max() + b.max())
        if new <= cur or (heat > 0 and rng.random() < math.exp(-(new - cur) / heat)):
            members[s][i], members[t][j] = y, x
            cur = new
            accepted += 1
            ratio = imbalance()
            if cur < best:
                best, best_ratio, best_owner = cur, ratio, st.owner.copy()
            if ratio < least:
                least, least_metric = ratio, cur
        else:
            st.owner[x], st.owner[y] = s, t
            f[s], b[s], f[t], b[t] = was
    return AnnealResult(
        start, start_ratio, best, best_ratio, least, least_metric, swaps, accepted, best_owner
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mask", default="docs4k_full", help=f"comma list of {', '.join(FAMILY_MASKS)}")
    ap.add_argument("--tokens-per-gpu", default="2048", help="comma list")
    ap.add_argument("--cp", default="16", help="comma list")
    ap.add_argument("--start", default="plan,contiguous", help=f"comma list of {', '.join(_STARTS)}")
    ap.add_argument("--swaps", type=int, default=200_000)
    ap.add_argument("--temperature", type=float, default=0.003)
    ap.add_argument("--seed", type=int, default=0, help="the walk's and the documents' seed")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    starts = args.start.split(",")
    if any(s not in _STARTS for s in starts):
        ap.error(f"--start must be among {_STARTS}, got {args.start!r}")
    rows = []
    print(
        "mask               tok/GPU  cp  start       plan ms  best ms  best/plan  imb@best  least imb  ms there"
    )
    for name in args.mask.split(","):
        for tpg in (int(x) for x in args.tokens_per_gpu.split(",")):
            for cp in (int(x) for x in args.cp.split(",")):
                plan, tables, owner = family_placement(name, tpg * cp, cp, args.seed)
                law = tables.law
                plan_metric = anneal(owner, tables, swaps=1, temperature=0.0).start_metric_ms
                for start in starts:
                    first = (
                        owner
                        if start == "plan"
                        else np.repeat(np.arange(cp), [len(p) for p in plan.partitions])
                    )
                    t0 = time.perf_counter()
                    res = anneal(
                        first, tables, swaps=args.swaps, temperature=args.temperature, seed=args.seed
                    )
                    row = {"mask": name, "tokens_per_gpu": tpg, "cp": cp, "start": start, "law": law.backend,
                           "chunk_size": plan.chunk_size, "swaps": res.swaps, "accepted": res.accepted,
                           "temperature": args.temperature, "seed": args.seed,
                           "plan_metric_ms": plan_metric, "start_metric_ms": res.start_metric_ms,
                           "start_time_imbalance": res.start_time_imbalance,
                           "best_metric_ms": res.best_metric_ms, "best_time_imbalance": res.best_time_imbalance,
                           "least_time_imbalance": res.least_time_imbalance,
                           "least_time_imbalance_metric_ms": res.least_time_imbalance_metric_ms,
                           "seconds": time.perf_counter() - t0}  # fmt: skip
                    rows.append(row)
                    print(f"{name:18s} {tpg:7d} {cp:3d}  {start:10s} {plan_metric:8.3f} {res.best_metric_ms:8.3f} "
                          f"{res.best_metric_ms / plan_metric:9.3f}  {res.best_time_imbalance:8.3f}  "
                          f"{res.least_time_imbalance:9.3f}  {res.least_time_imbalance_metric_ms:8.3f}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
