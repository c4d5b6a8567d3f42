"""A training loop's key step on the CPU (a new key and one dispatch per step), against a baseline commit.

What it measures and how to run it: docs/benchmarks/cases.md (key-step).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "1861836"
"""The commit the key step is compared with (before the dispatch choice tried candidate assignments)."""
HEADS_Q, HEADS_KV, HEAD_DIM, HIDDEN = 32, 8, 128, 64
"""The key's attention shape, and the width of the tensor each step dispatches."""
LAUNCH_TIMEOUT_S = 900


# ------------------------------------------------------------------------------------------------ masks
def step_masks(tokens: int, steps: int, seed: int) -> list[list[list]]:
    """``steps`` masks of packed causal documents over ``tokens`` tokens, one per step (seeds ``seed``,
    ``seed + 1``, ...): ``[q_ranges, k_ranges, types]`` with the document ranges and type 1 (causal)."""
    from magi_solver import long_tailed_cu_seqlens

    out = []
    for i in range(steps):
        cu = long_tailed_cu_seqlens(tokens, seed=seed + i)
        docs = [[a, b] for a, b in itertools.pairwise(cu)]
        out.append([docs, docs, [1] * len(docs)])
    return out


# ----------------------------------------------------------------------------------------------- trees
def tree_pythonpath(tree: Path) -> str:
    """PYTHONPATH of a tree's packages: every ``packages/*/src``."""
    srcs = sorted(str(p) for p in (tree / "packages").glob("*/src") if p.is_dir())
    if not srcs:
        raise FileNotFoundError(f"no packages/*/src under {tree}")
    return os.pathsep.join(srcs)


def unpack_commit(commit: str, dest: Path) -> Path:
    """``packages/`` of ``commit`` (``git archive``) unpacked under ``dest``; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "packages"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        raise RuntimeError(
            f"cannot read commit {commit!r} from {ROOT} (a git clone holding it is needed; or --no-baseline): "
            f"{err.decode(errors='replace').strip() or e}"
        ) from None
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


# ---------------------------------------------------------------------------------------------- ranks
def launch(tree: Path, masks_file: Path, cp: int, tmp: Path) -> list[dict]:
    """Run the worker on ``cp`` fresh gloo ranks with ``tree``'s packages; each rank's result."""
    run_dir = Path(tempfile.mkdtemp(prefix="keystep_", dir=tmp))
    env = {
        **os.environ,
        "PYTHONPATH": tree_pythonpath(tree),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    procs = []
    for rank in range(cp):
        out = run_dir / f"rank{rank}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(rank), "--cp", str(cp),
               "--init", f"file://{run_dir}/rendezvous", "--masks-file", str(masks_file), "--result", str(out),
               "--tree", str(tree)]  # fmt: skip
        log = open(run_dir / f"rank{rank}.log", "w")  # closed after the rank ends
        procs.append(
            (subprocess.Popen(cmd, env=env, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT), log, out)
        )
    results, failed = [], []
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    for rank, (p, log, out) in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        if p.returncode != 0 or not out.exists():
            tail = (run_dir / f"rank{rank}.log").read_text()[-3000:]
            failed.append(f"--- rank {rank} (exit {p.returncode}) ---\n{tail}")
        else:
            results.append(json.loads(out.read_text()))
    if failed:
        raise RuntimeError(f"key-step ranks failed on {tree}:\n" + "\n".join(failed))
    return results


def worker(args: argparse.Namespace) -> int:
    """One rank: join the gloo group, build the warm-up keys, then time a new key + dispatch per step."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=args.init, rank=args.worker, world_size=args.cp)
    import magi_attention
    import magi_solver
    from magi_attention import dispatch, magi_attn_flex_key

    tree = Path(args.tree).resolve()
    for mod in (magi_attention, magi_solver):  # a package missing from the tree would come from elsewhere
        if tree not in Path(mod.__file__).resolve().parents:
            raise RuntimeError(f"{mod.__name__} imported from {mod.__file__}, not from {tree}")
    spec = json.loads(Path(args.masks_file).read_text())
    rows = []
    for case in spec["cases"]:
        tokens = case["tokens"]
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(0))
        times = []
        for i, (q, k, t) in enumerate(case["warmup"] + case["steps"]):
            dist.barrier()  # every rank starts the step together: a step's time is then its slowest rank's
            t0 = time.perf_counter()
            key = magi_attn_flex_key(q, k, t, tokens, tokens, HEADS_Q, HEADS_KV, HEAD_DIM, dist.group.WORLD)
            local = dispatch(x, key)
            seconds = time.perf_counter() - t0
            if local.shape[1] != HIDDEN:
                raise RuntimeError(f"dispatch returned {tuple(local.shape)}")
            if i >= len(case["warmup"]):
                times.append(seconds)
        rows.append({"tokens": tokens, "seconds": times})
    dist.barrier()
    dist.destroy_process_group()
    Path(args.result).write_text(json.dumps({"rank": args.worker, "rows": rows}))
    # leave without the interpreter's teardown: a gloo thread still winding down there can abort the
    # process ("terminate called without an active exception") after the result is written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------- driver
def _stats(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "p25_ms": q[0], "p75_ms": q[2], "min_ms": min(ms),
            "max_ms": max(ms), "steps": len(ms)}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    """Every round: each tree once (alternating which goes first), all token counts; the summary."""
    trees = {"this": ROOT}
    with tempfile.TemporaryDirectory(prefix="magi_key_step_") as tmp_s:
        tmp = Path(tmp_s)
        if args.baseline:
            trees = {"baseline": unpack_commit(args.baseline, tmp / "baseline"), **trees}
        cases = []
        for n, tokens in enumerate(args.tokens):
            seed = args.seed + 100_000 * n
            cases.append({
                "tokens": tokens,
                "warmup": step_masks(tokens, args.warmup, seed + 50_000),  # other seeds than the timed steps
                "steps": step_masks(tokens, args.steps, seed),
            })  # fmt: skip
        masks_file = tmp / "masks.json"
        masks_file.write_text(json.dumps({"cases": cases}))
        per_step: dict[str, dict[int, list[float]]] = {name: {t: [] for t in args.tokens} for name in trees}
        per_round: dict[str, dict[int, list[float]]] = {name: {t: [] for t in args.tokens} for name in trees}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                ranks = launch(trees[name], masks_file, args.cp, tmp)
                for c, case in enumerate(cases):
                    # a step's time: its slowest rank's (they start together, after a barrier)
                    slowest = [max(ms) * 1e3 for ms in zip(*(rk["rows"][c]["seconds"] for rk in ranks))]
                    per_step[name][case["tokens"]] += slowest
                    per_round[name][case["tokens"]].append(statistics.median(slowest))
                print(f"# round {r + 1}/{args.rounds}: {name} done", flush=True)
    rows = []
    for tokens in args.tokens:
        row = {"tokens": tokens, "cp": args.cp}
        for name in trees:
            row[name] = _stats(per_step[name][tokens]) | {"round_medians_ms": per_round[name][tokens]}
        if "baseline" in trees:
            row["ratio_this_over_baseline"] = row["this"]["median_ms"] / row["baseline"]["median_ms"]
            # the fastest steps, which the machine's other jobs delay least: on shared cores the median's
            # ratio drifts with the load, these say what each tree's own work costs
            row["ratio_p25_this_over_baseline"] = row["this"]["p25_ms"] / row["baseline"]["p25_ms"]
            row["ratio_min_this_over_baseline"] = row["this"]["min_ms"] / row["baseline"]["min_ms"]
        rows.append(row)
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": _head(),
        "baseline": args.baseline,
        "masks": "packed causal documents: magi_solver.long_tailed_cu_seqlens(tokens, seed), a new seed per step",
        "heads": [HEADS_Q, HEADS_KV],
        "head_dim": HEAD_DIM,
        "steps_per_round": args.steps,
        "warmup_per_round": args.warmup,
        "rounds": args.rounds,
        "rows": rows,
    }


def _head() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def print_table(result: dict) -> None:
    trees = ["baseline", "this"] if result["baseline"] else ["this"]
    head = f"{'tokens':>7} {'cp':>3}"
    for name in trees:
        label = f"{name} ({result['baseline']})" if name == "baseline" else f"{name} ({result['commit']})"
        head += f"  {label + ' median ms [p25, p75]':>38}"
    print(head + ("  this/baseline (p25, min)" if result["baseline"] else ""))
    for row in result["rows"]:
        line = f"{row['tokens']:>7} {row['cp']:>3}"
        for name in trees:
            s = row[name]
            line += f"  {s['median_ms']:>18.1f} [{s['p25_ms']:.1f}, {s['p75_ms']:.1f}]".ljust(40)
        if "ratio_this_over_baseline" in row:
            line += (
                f"  {row['ratio_this_over_baseline']:>13.2f}x ({row['ratio_p25_this_over_baseline']:.2f}x, "
                f"{row['ratio_min_this_over_baseline']:.2f}x)"
            )
        print(line)


def _positive_ints(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks key-step", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tokens", type=_positive_ints, default=[2048, 65536], help="total tokens (comma-separated)"
    )
    p.add_argument("--cp", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per token count and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (other masks) first, per launch")
    p.add_argument(
        "--rounds", type=int, default=4, help="rounds; each runs every tree once, alternating order"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default=BASELINE, help=f"commit to compare with (default {BASELINE})")
    p.add_argument("--no-baseline", dest="baseline", action="store_const", const=None,
                   help="time this checkout only")  # fmt: skip
    p.add_argument(
        "--json",
        default=str(ROOT / "benchmarks" / "results" / "key_step_cpu.json"),
        help="result file (default benchmarks/results/key_step_cpu.json)",
    )
    # a rank (internal): started by the driver with one tree's packages on PYTHONPATH
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    p.add_argument("--masks-file", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("cp", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    result = run(args)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"# written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
