"""`magi-attention-plan`: plan your own mask for several cp sizes and compare with ring, all-gather and Ulysses.

Pure Python (numpy and rich; no torch). Examples:

    magi-attention-plan --mask causal --doc-lens 8192,30000,4096,90000 --cp 2,4
    magi-attention-plan --mask varlen-causal --total 1048576 --cp 8,16,64 --json
    magi-attention-plan --mask sliding-window --total 262144 --cp 8 --plot out/
    magi-attention-plan --slices my_mask.json --cp 16 --hardware b200

With no --chunk-size, each cp size gets the runtime's own choice of chunk size
and dispatch algorithm (`magi_solver.plan_attention`).

Plots (`--plot DIR`) need matplotlib, the `plot` extra:
`python scripts/install.py plot` from a clone (see docs/install.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from . import default_chunk_size, env
from .kernel_choice import busiest_rank_features, kernel_key_ids, load_kernel_table, pick_kernel
from .tools.cli_input import (
    DTYPE_BYTES,
    MASKS,
    CliError,
    build_mask,
    hardware_from_args,
    int_list,
    lognormal_doc_lens,
    workload_from_args,
)
from .tools.cli_report import render_records, write_plots
from .tools.hardware import HARDWARE, HardwareProfile, MaskFamily
from .tools.predict import predict_cp

__all__ = ["CliError", "build_mask", "lognormal_doc_lens", "main", "parse_args"]

_DEFAULT_CP = "8,16,64"
_HELP_WIDTH = 80


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line (see `magi-attention-plan --help`)."""
    p = argparse.ArgumentParser(
        prog="magi-attention-plan",
        description="Plan a context-parallel attention mask for several cp sizes: balance,\n"
        "communication and predicted time against ring, all-gather and Ulysses,\n"
        "from one cost model.",
        # 80 columns whatever the terminal says (the epilog and description are wrapped by hand)
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=_HELP_WIDTH),
        epilog=__doc__.split("\n\n", 1)[1],
    )
    m = p.add_argument_group("mask (a builder and its documents, or --slices)")
    m.add_argument(
        "--mask",
        choices=MASKS,
        default="causal",
        metavar="NAME",
        help=f"mask builder: {', '.join(MASKS)} (default causal)",
    )
    m.add_argument("--slices", metavar="FILE", help="JSON mask: {q_ranges, k_ranges, types} or {slices}")
    m.add_argument("--cu-seqlens", metavar="LIST", help="document boundaries, e.g. 0,1024,4096")
    m.add_argument("--doc-lens", metavar="LIST", help="document lengths, e.g. 1024,3072")
    m.add_argument(
        "--doc-lens-file", metavar="FILE", help="document lengths, one per line (or comma-separated)"
    )
    m.add_argument(
        "--total", type=int, default=1 << 20, help="tokens when no documents are given (default 1M)"
    )
    m.add_argument(
        "--num-docs", type=int, help="with --total: log-normal documents (default 300 for varlen-*, else 1)"
    )
    m.add_argument("--seed", type=int, default=0, help="seed of the log-normal document lengths")
    m.add_argument("--window", default="4096,0", help="sliding/global window LEFT,RIGHT (-1 = unbounded)")
    m.add_argument("--num-global", type=int, default=64, help="global-window: global tokens per document")
    m.add_argument("--block-size", type=int, default=2048, help="block-causal: tokens per block")
    m.add_argument(
        "--prefix-len", type=int, default=1024, help="prefix-lm: bidirectional prefix per document"
    )
    families = [f.value for f in MaskFamily]
    m.add_argument(
        "--family",
        choices=families,
        metavar="NAME",
        help=f"kernel throughput class to use: {', '.join(families)}",
    )

    s = p.add_argument_group("model and planner")
    s.add_argument("--cp", default=_DEFAULT_CP, help=f"cp sizes (default {_DEFAULT_CP})")
    s.add_argument(
        "--chunk-size",
        type=int,
        help="dispatch chunk size in tokens (default: the runtime's choice per mask and cp size)",
    )
    s.add_argument("--heads", default="64:8", help="query:key-value heads (default 64:8)")
    s.add_argument("--head-dim", type=int, default=128)
    s.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    s.add_argument("--degree", default="dynamic", help="overlap degree: dynamic (default) or an int >= 0")
    s.add_argument("--max-degree", type=int, default=4, help="largest degree the dynamic choice tries")
    s.add_argument(
        "--uneven-shard",
        action="store_true",
        help="magi without padding (DispatchConfig(uneven_shard=True)); baselines stay padded",
    )

    h = p.add_argument_group("hardware (a profile, then explicit numbers override it)")
    h.add_argument("--hardware", choices=sorted(HARDWARE), default="h200")
    h.add_argument("--fwd-tflops", type=float, help="forward kernel TFLOP/s (every mask family)")
    h.add_argument("--bwd-tflops", type=float, help="backward kernel TFLOP/s (every mask family)")
    h.add_argument("--nvlink-gbps", type=float, help="per-GPU bandwidth inside a node, GB/s")
    h.add_argument("--internode-gbps", type=float, help="per-GPU bandwidth between nodes, GB/s")
    h.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    h.add_argument("--cost-profile", metavar="FILE", help="JSON cost profile for the per-call constants")

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON list (one record per cp size)")
    o.add_argument("--plot", metavar="DIR", help="write PNGs to DIR (needs matplotlib: install row `plot`)")
    o.add_argument(
        "--wide",
        action="store_true",
        help="one table per cp size with every column, however wide (a narrow terminal otherwise gets "
        "the columns in two or more tables, so that no number is cut)",
    )
    o.add_argument("--quiet", action="store_true", help="no progress and no summary on stderr")
    return p.parse_args(argv)


# A scaling curve needs this many cp sizes: with fewer, --plot adds the default sizes that fit the mask.
_MIN_SCALING_POINTS = 3


def scaling_cps(cps: Sequence[int], total: int, chunk_size: int, defaults: Sequence[int]) -> list[int]:
    """The cp sizes of `scaling.png`: the user's, plus (when fewer than three) the default sizes and then
    powers of two, keeping only sizes that give every rank at least one chunk."""
    out = set(cps)
    if len(out) >= _MIN_SCALING_POINTS:
        return sorted(out)
    chunks = -(-total // chunk_size)
    extra = [c for c in defaults if c <= chunks] + [1 << i for i in range(1, 11) if (1 << i) <= chunks]
    for c in extra:
        if len(out) >= _MIN_SCALING_POINTS:
            break
        out.add(c)
    return sorted(out)


def _check_plot_backend() -> None:
    from .tools import plot  # numpy only; matplotlib is imported by the drawing functions

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(f"--plot needs matplotlib: {plot.PLOT_INSTALL_HINT}") from None


def auto_kernel(q, k, t, plan, hw: HardwareProfile, head_dim: int) -> tuple[str | None, str]:
    """What the runtime's ``kernel_backend="auto"`` picks for this plan on ``hw`` (assuming the GPU runs
    every backend its table measured): ``(backends, reason)``, backends "fa4" or "fa4/cudnn" (forward /
    backward when they differ), None without a table or row."""
    table = load_kernel_table(hw.name)
    if table is None:
        return None, f"no measured kernel table for {hw.name}: the runtime uses its capability rule"
    rows = [plan.dispatch.position_ids(r) for r in range(plan.dispatch.cp_size)]
    keys = kernel_key_ids(rows, plan.kv_layout)
    candidates = sorted({b for row in table.rows for b in row["ms"]})
    picked = pick_kernel(table, busiest_rank_features(q, k, t, rows, rank_keys=keys), head_dim, candidates)
    if picked is None:
        return None, f"the {hw.name} table has no row for head_dim {head_dim}: the runtime's capability rule"
    name = picked.forward if picked.forward == picked.backward else f"{picked.forward}/{picked.backward}"
    return name, picked.reason


def run(args: argparse.Namespace) -> int:
    """Run the CLI on parsed arguments (returns the exit status)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if args.plot:
        _check_plot_backend()  # fail before planning, not after
    cps = int_list(args.cp, "--cp")
    if any(c < 1 for c in cps):
        raise CliError(f"--cp sizes must be >= 1, got {args.cp!r}")
    hw = hardware_from_args(args)
    work = workload_from_args(args)
    q, k, t, total, fam, desc = build_mask(args)
    err = Console(stderr=True)
    # the terminal's width (or $COLUMNS); piped without $COLUMNS, wide enough for one table per cp size
    width = None if sys.stdout.isatty() or env.columns_set() else 132
    out = Console(highlight=False, width=width)
    show_progress = not args.quiet and err.is_terminal
    t0 = time.perf_counter()
    records, plans = [], []
    # --plot's scaling curve: the user's sizes, plus the defaults when fewer than three are given
    smallest_chunk = work.chunk_size or default_chunk_size(total, max(cps))  # the largest the choice tries
    curve = scaling_cps(cps, total, smallest_chunk, int_list(_DEFAULT_CP, "--cp")) if args.plot else cps
    extra = [c for c in curve if c not in cps]
    by_cp: dict[int, dict[str, Any]] = {}
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} cp sizes"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not show_progress,
    ) as progress:
        task = progress.add_task("planning", total=len(cps) + len(extra))
        for cp in [*cps, *extra]:
            progress.update(task, description=f"planning cp {cp}")
            rec, plan = predict_cp(q, k, t, total, cp, hardware=hw, family=fam, workload=work)
            if cp in cps:
                rec["kernel_auto"], rec["kernel_auto_reason"] = auto_kernel(q, k, t, plan, hw, work.head_dim)
                records.append(rec)
                plans.append(plan)
            by_cp[cp] = rec
            progress.advance(task)
    written: list[str] = []
    if args.plot:
        scaling = [by_cp[c] for c in curve]
        written = write_plots(args.plot, q, k, t, total, records, plans, scaling)
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        est = " (estimate)" if hw.estimate else ""
        header = (
            f"[bold]magi-attention-plan[/bold]: {desc}, {total:,} tokens, mask family {fam.value}; heads "
            f"{work.num_heads_q}:{work.num_heads_kv}, head_dim {work.head_dim}, {args.dtype}; hardware "
            f"{hw.name}{est}: {hw.source}"
        )
        render_records(records, header, out, wide=args.wide)
        picks = ", ".join(f"cp {r['cp']}: {r['kernel_auto'] or 'capability rule'}" for r in records)
        out.print(f"kernel_backend='auto' on {hw.name}, head_dim {work.head_dim}: {picks}")
        out.print(f"[dim]({records[0]['kernel_auto_reason']})[/dim]")
    sys.stdout.flush()
    if not args.quiet:
        slowest = max(records, key=lambda r: r["plan_seconds"])
        plots = ""
        if written:
            added = f" (cp {', '.join(map(str, extra))} added for the curve)" if extra else ""
            plots = f"; {len(written)} PNGs in {args.plot}, scaling.png over cp {', '.join(map(str, curve))}{added}"
        err.print(
            f"[dim]planned {len(records)} cp size(s) in {time.perf_counter() - t0:.2f} s "
            f"(slowest: cp {slowest['cp']}, {slowest['plan_seconds']:.2f} s){plots}[/dim]",
            highlight=False,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point of `magi-attention-plan`."""
    args = parse_args(argv)
    try:
        return run(args)
    except (CliError, ValueError, TypeError) as e:
        print(f"magi-attention-plan: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `magi-attention-plan ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
