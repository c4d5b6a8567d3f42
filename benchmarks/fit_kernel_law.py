"""Fit the kernel law (`magi_solver.kernel_law`) to per-rank times of scaling runs and write the law file.
What it measures and how to run it: docs/benchmarks/cases.md (fit-law)."""

import json
import math
import os
import sys

import numpy as np

from benchmarks.cli import run_module, write_json

KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2  # K and V, 8 KV heads, d 128, bf16
TERMS = ("tiles", "key_columns", "rows")


def rank_records(paths: list[str]) -> list[dict]:
    """One dict per fully timed rank: file, mask, cp, fwd / bwd backend, tiles, key_columns, rows, fwd_us,
    bwd_us."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for sim in data.get("sim", []):
            fwd_b, _, bwd_b = sim["backend"].partition("/")
            tpg = sim["tokens_per_gpu"]
            for r in sim.get("ranks", []):
                if not r.get("full_timing", False):
                    continue
                recv = r.get("recv_tokens", sum(r.get("stage_bytes", [])) / KV_BYTES_PER_TOKEN)
                own = r.get("local_tokens", tpg)
                out.append({"file": os.path.basename(path), "mask": sim["mask"], "cp": sim["cp"], "fwd_backend": fwd_b,
                            "bwd_backend": bwd_b or fwd_b, "tiles": r.get("tiles", r["area"] / 128**2),
                            "key_columns": r.get("key_columns", (own + recv) / 128),
                            "rows": r.get("rows", math.ceil(own / 128)), "fwd_us": r["fwd_ms"] * 1e3,
                            "bwd_us": r["bwd_ms"] * 1e3})  # fmt: skip
    return out


def errors(coef: dict[str, float], recs: list[dict], direction: str) -> dict[str, float]:
    """R^2, median and max relative error of `coef` on `recs` (direction "fwd" or "bwd")."""
    x = np.asarray([[r[t] for t in TERMS] for r in recs], dtype=np.float64)
    y = np.asarray([r[f"{direction}_us"] for r in recs], dtype=np.float64)
    p = x @ np.asarray([coef[t] for t in TERMS]) + coef.get("call", 0.0)
    rel = np.abs(p - y) / y
    r2 = 1.0 - float(((y - p) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30))
    return {"r2": round(r2, 5), "median_error": round(float(np.median(rel)), 4), "max_error": round(float(rel.max()), 4)}  # fmt: skip


def fit(recs: list[dict], direction: str) -> dict[str, float]:
    """Least squares of `us = sum coef * term` with every coefficient >= 0 (negative terms dropped)."""
    terms = list(TERMS)
    y = np.asarray([r[f"{direction}_us"] for r in recs], dtype=np.float64)
    while True:
        x = np.asarray([[r[t] for t in terms] for r in recs], dtype=np.float64)
        sol, *_ = np.linalg.lstsq(x, y, rcond=None)
        if (sol >= 0).all() or len(terms) == 1:
            coef = dict(zip(terms, (max(float(v), 0.0) for v in sol)))
            return {t: round(coef.get(t, 0.0), 4) for t in TERMS} | {"call": 0.0}
        terms.pop(int(np.argmin(sol)))


def add_arguments(ap) -> None:
    ap.add_argument("files", nargs="+", help="scaling JSON files")
    ap.add_argument("--out", required=True, help="law file to write (kernel_tables/<gpu>_law.json)")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--keep", action="append", default=[], help="DIRECTION/BACKEND entry of --out to keep")


def main(args) -> int:
    recs = rank_records(args.files)
    if not recs:
        print("no fully timed ranks in the files", file=sys.stderr)
        return 1
    old = {}
    if args.keep and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as f:
            old = json.load(f).get("laws", {})
    names = ", ".join(sorted({r["file"] for r in recs}))
    laws: dict[str, dict] = {}
    for direction in ("fwd", "bwd"):
        groups: dict[str, list[dict]] = {}
        for r in recs:
            groups.setdefault(r[f"{direction}_backend"], []).append(r)
        fitted = {}
        for backend, rs in sorted(groups.items()):
            masks = sorted({r["mask"] for r in rs})
            kept = f"{direction}/{backend}" in args.keep and backend in old
            if kept:
                coef = {t: old[backend][direction][t] for t in (*TERMS, "call")}
                src = old[backend][direction].get("source", "")
            elif len(masks) < 2:
                continue
            else:
                coef = fit(rs, direction)
                src = f"fitted by benchmarks/fit_kernel_law.py on {len(rs)} ranks of {', '.join(masks)} ({names})"
            err = errors(coef, rs, direction)
            fitted[backend] = coef | {"estimate": False, "source": src, "ranks": len(rs)} | err
            print(f"{direction} {backend}: {coef} on {len(rs)} ranks: {err}")
        for backend in ("cudnn", "fa4"):
            laws.setdefault(backend, {})
            if backend in fitted:
                laws[backend][direction] = fitted[backend]
            elif fitted:
                other = sorted(fitted)[0]
                laws[backend][direction] = {t: fitted[other][t] for t in (*TERMS, "call")} | {"estimate": True,
                    "source": f"no {backend} ranks of two mask families in the data: {other}'s constants"}  # fmt: skip
    out = {"gpu_kind": args.gpu, "unit": "us per tile (128^2 pairs), key column (128 keys), row (128 queries), call",
           "shape": "64:8 heads, head dim 128, bf16", "data": sorted({r["file"] for r in recs}), "laws": laws}  # fmt: skip
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
