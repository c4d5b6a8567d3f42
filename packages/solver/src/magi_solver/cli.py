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
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import (
    FAMILY_MASKS,
    default_chunk_size,
    env,
    family_doc_lengths,
    lognormal_doc_lengths,
    make_block_causal_mask,
    make_family_mask,
    make_global_window_mask,
    make_prefix_lm_mask,
    make_sliding_window_mask,
    make_varlen_causal_mask,
    make_varlen_full_mask,
)
from .cost_model import load_profile
from .kernel_choice import busiest_rank_features, kernel_key_ids, load_kernel_table, pick_kernel
from .tools.hardware import HARDWARE, HardwareProfile, MaskFamily, get_hardware
from .tools.predict import SCHEMES, Workload, predict_cp

__all__ = ["build_mask", "main", "parse_args"]

MASKS = (
    "full",
    "causal",
    "varlen-full",
    "varlen-causal",
    "sliding-window",
    "global-window",
    "block-causal",
    "prefix-lm",
    *(f for f in FAMILY_MASKS if f not in ("full", "causal")),
)
# the mask families' kernel throughput classes (`make_family_mask`; full and causal are the CLI's own)
_FAMILY_KIND = {
    "docs4k_causal": MaskFamily.VARLEN_CAUSAL,
    "docs4k_full": MaskFamily.VARLEN_FULL,
    "short_docs_causal": MaskFamily.VARLEN_CAUSAL,
    "docs4k_window2048": MaskFamily.SLIDING_WINDOW,
    "video_clips": MaskFamily.BLOCK_CAUSAL,
}
_DEFAULT_CP = "8,16,64"
_HELP_WIDTH = 80
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_SCHEME_LABEL = {
    "magi": "magi",
    "ring": "ring (zigzag)",
    "all_gather": "all-gather K/V",
    "ulysses": "Ulysses",
}


class CliError(ValueError):
    """Bad command-line input: printed as `magi-attention-plan: error: ...` with exit status 2."""


def _int_list(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise CliError(f"{name} must be integers separated by commas, got {text!r}") from None
    if not vals:
        raise CliError(f"{name} is empty")
    return vals


def _pair(text: str, name: str) -> tuple[int, int]:
    vals = _int_list(text, name)
    if len(vals) != 2:
        raise CliError(f"{name} must be two integers LEFT,RIGHT, got {text!r}")
    return vals[0], vals[1]


def _read_doc_lens(path: str) -> list[int]:
    try:
        with open(path, encoding="utf-8") as f:
            return _int_list(f.read(), f"--doc-lens-file {path}")
    except OSError as e:
        raise CliError(f"cannot read --doc-lens-file: {e}") from None


def lognormal_doc_lens(total: int, num_docs: int, seed: int) -> list[int]:
    """`num_docs` long-tailed (log-normal) lengths, each >= 1, summing to `total` (seeded)."""
    if not 1 <= num_docs <= total:
        raise CliError(f"--num-docs must lie in [1, --total = {total}], got {num_docs}")
    return lognormal_doc_lengths(total, sigma=1.0, seed=seed, num_docs=num_docs)


def _cu_seqlens(args: argparse.Namespace) -> tuple[list[int], str]:
    """Document boundaries from --cu-seqlens, --doc-lens(-file) or --total (+ --num-docs)."""
    given = [x for x in ("cu_seqlens", "doc_lens", "doc_lens_file") if getattr(args, x) is not None]
    if len(given) > 1:
        raise CliError("give at most one of --cu-seqlens, --doc-lens, --doc-lens-file")
    if args.cu_seqlens is not None:
        cu = _int_list(args.cu_seqlens, "--cu-seqlens")
        if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
            raise CliError(f"--cu-seqlens must start at 0 and never decrease, got {args.cu_seqlens!r}")
        return cu, f"{len(cu) - 1} documents (--cu-seqlens)"
    if given:
        lens = (
            _read_doc_lens(args.doc_lens_file)
            if args.doc_lens_file
            else _int_list(args.doc_lens, "--doc-lens")
        )
        if any(n <= 0 for n in lens):
            raise CliError("document lengths must be positive")
        return [0, *np.cumsum(lens).tolist()], f"{len(lens)} documents"
    total = args.total
    varlen = args.mask.startswith("varlen-")
    num = args.num_docs if args.num_docs is not None else (300 if varlen else 1)
    if num == 1:
        return [0, total], "1 document"
    lens = lognormal_doc_lens(total, num, args.seed)
    return [0, *np.cumsum(lens).tolist()], f"{num} log-normal documents (seed {args.seed})"


def _load_slices(path: str) -> tuple[list, list, Any, int]:
    """A JSON mask: {"q_ranges", "k_ranges", "types"} or {"slices": [[qs, qe, ks, ke, type], ...]},
    with an optional "total_seqlen" (default: the largest range end)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CliError(f"cannot read --slices {path}: {e}") from None
    if not isinstance(data, dict):
        raise CliError(f"--slices {path}: expected a JSON object")
    if "slices" in data:
        rows = data["slices"]
        q = [[r[0], r[1]] for r in rows]
        k = [[r[2], r[3]] for r in rows]
        t = [r[4] if len(r) > 4 else "full" for r in rows]
    elif "q_ranges" in data and "k_ranges" in data:
        q, k = data["q_ranges"], data["k_ranges"]
        t = data.get("types", "full")
    else:
        raise CliError(f"--slices {path}: needs `slices` or `q_ranges` + `k_ranges` (and `types`)")
    if not q:
        raise CliError(f"--slices {path}: no slices")
    total = int(data.get("total_seqlen", max(max(e for _, e in q), max(e for _, e in k))))
    return q, k, t, total


def build_mask(args: argparse.Namespace) -> tuple[Any, Any, Any, int, MaskFamily, str]:
    """`(q_ranges, k_ranges, types, total, family, description)` of the mask the arguments describe."""
    if args.slices:
        q, k, t, total = _load_slices(args.slices)
        fam = MaskFamily(args.family) if args.family else MaskFamily.OTHER
        return q, k, t, total, fam, f"{len(q)} slices from {os.path.basename(args.slices)}"
    name = args.mask
    if name in _FAMILY_KIND:
        return _family_mask(args)
    cu, docs = _cu_seqlens(args)
    total = cu[-1]
    many = len(cu) > 2
    if name in ("full", "varlen-full"):
        spec = make_varlen_full_mask(cu)
        fam = MaskFamily.VARLEN_FULL if many else MaskFamily.FULL
    elif name in ("causal", "varlen-causal"):
        spec = make_varlen_causal_mask(cu)
        fam = MaskFamily.VARLEN_CAUSAL if many else MaskFamily.CAUSAL
    elif name == "sliding-window":
        spec = make_sliding_window_mask(cu, _pair(args.window, "--window"))
        fam = MaskFamily.SLIDING_WINDOW
    elif name == "global-window":
        spec = make_global_window_mask(cu, _pair(args.window, "--window"), args.num_global)
        fam = MaskFamily.SLIDING_WINDOW
    elif name == "block-causal":
        spec = make_block_causal_mask(cu, args.block_size)
        fam = MaskFamily.BLOCK_CAUSAL
    elif name == "prefix-lm":
        spec = make_prefix_lm_mask(cu, args.prefix_len)
        fam = MaskFamily.VARLEN_CAUSAL if many else MaskFamily.CAUSAL
    else:  # argparse restricts the choices
        raise CliError(f"--mask must be one of {MASKS}, got {name!r}")
    if args.family:
        fam = MaskFamily(args.family)
    return spec.q_ranges, spec.k_ranges, spec.types, total, fam, f"{name}, {docs}"


def _family_mask(args: argparse.Namespace) -> tuple[Any, Any, Any, int, MaskFamily, str]:
    """A mask family of `make_family_mask` over --total tokens (its own documents, drawn with --seed)."""
    given = [
        x for x in ("cu_seqlens", "doc_lens", "doc_lens_file", "num_docs") if getattr(args, x) is not None
    ]
    if given:
        opts = ", ".join("--" + x.replace("_", "-") for x in given)
        raise CliError(f"--mask {args.mask} draws its own documents from --total and --seed; drop {opts}")
    if args.total < 1:
        raise CliError(f"--total must be at least 1, got {args.total}")
    spec = make_family_mask(args.mask, args.total, args.seed)
    fam = MaskFamily(args.family) if args.family else _FAMILY_KIND[args.mask]
    n = len(family_doc_lengths(args.mask, args.total, args.seed))
    unit = "clips" if args.mask == "video_clips" else "documents"
    return (
        spec.q_ranges,
        spec.k_ranges,
        spec.types,
        args.total,
        fam,
        f"{args.mask}, {n} {unit} (seed {args.seed})",
    )


def _hardware(args: argparse.Namespace) -> HardwareProfile:
    hw = get_hardware(args.hardware)
    base = load_profile(args.cost_profile) if args.cost_profile else None
    return hw.with_overrides(
        fwd_tflops=args.fwd_tflops,
        bwd_tflops=args.bwd_tflops,
        nvlink_gbps=args.nvlink_gbps,
        internode_gbps=args.internode_gbps,
        gpus_per_node=args.gpus_per_node,
        base=base,
    )


def _workload(args: argparse.Namespace) -> Workload:
    heads = _int_list(args.heads.replace(":", ","), "--heads")
    if len(heads) != 2:
        raise CliError(f"--heads must be Q:KV (e.g. 64:8), got {args.heads!r}")
    if args.degree == "dynamic":
        degree = None
    else:
        try:
            degree = int(args.degree)
        except ValueError:
            raise CliError(f"--degree must be `dynamic` or an int >= 0, got {args.degree!r}") from None
    return Workload(
        num_heads_q=heads[0],
        num_heads_kv=heads[1],
        head_dim=args.head_dim,
        bytes_per_elem=_DTYPE_BYTES[args.dtype],
        chunk_size=args.chunk_size,
        max_degree=args.max_degree,
        overlap_degree=degree,
        uneven_shard=args.uneven_shard,
    )


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
    s.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), default="bf16")
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


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_tokens(n: float | None) -> str:
    return "-" if n is None else f"{n:,.0f}"


# (header, cell) of the per-scheme columns, in order; a narrow terminal gets them in several tables
_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("imbal.", lambda s, t: f"{s['imbalance']:.3f}"),
    ("K/V tokens/rank", lambda s, t: _fmt_tokens(s["comm_tokens_per_rank"])),
    ("sent/rank fwd", lambda s, t: _fmt_bytes(s["comm_bytes_per_rank"])),
    ("fwd ms", lambda s, t: f"{s['fwd_ms']:.2f}"),
    ("bwd ms", lambda s, t: f"{s['bwd_ms']:.2f}"),
    ("fwd TF/s/GPU", lambda s, t: f"{s['fwd_tflops_per_gpu']:.0f}"),
    ("bwd TF/s/GPU", lambda s, t: f"{s['bwd_tflops_per_gpu']:.0f}"),
    ("vs magi", lambda s, t: "" if t is None else f"{(s['fwd_ms'] + s['bwd_ms']) / t:.2f}x"),
)


def _scheme_table(rec: dict[str, Any], columns: Sequence[int], title: str | None) -> Any:
    """One table of `rec`'s schemes with the `_COLUMNS` of the given indices (after the scheme name)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left", title_style="bold", caption_justify="left")
    t.add_column("scheme", justify="left", no_wrap=True)
    for i in columns:
        t.add_column(_COLUMNS[i][0], justify="right", no_wrap=True)
    magi = rec["schemes"]["magi"]
    magi_total = magi["fwd_ms"] + magi["bwd_ms"]
    for name in SCHEMES:
        s = rec["schemes"][name]
        if "skipped" in s:
            t.add_row(f"{_SCHEME_LABEL[name]} (n/a)", *["-"] * len(columns))
            t.caption = f"{_SCHEME_LABEL[name]}: {s['skipped']}"
            continue
        label = f"[bold]{_SCHEME_LABEL[name]}[/bold]" if name == "magi" else _SCHEME_LABEL[name]
        ref = None if name == "magi" else magi_total
        t.add_row(label, *(_COLUMNS[i][1](s, ref) for i in columns))
    return t


def _column_groups(rec: dict[str, Any], console: Any, wide: bool) -> list[list[int]]:
    """The `_COLUMNS` split into consecutive groups whose tables fit the console's width (one group when
    everything fits, or with --wide): a cut number is worse than a second table."""
    everything = list(range(len(_COLUMNS)))
    if wide:
        return [everything]
    unbounded = console.options.update_width(1 << 16)  # measure() clamps to the options' width

    groups: list[list[int]] = [[]]
    for i in everything:
        trial = groups[-1] + [i]
        if (
            groups[-1]
            and console.measure(_scheme_table(rec, trial, None), options=unbounded).maximum > console.width
        ):
            groups.append([i])
        else:
            groups[-1] = trial
    return groups


def _render(records: list[dict[str, Any]], header: str, console: Any, wide: bool = False) -> None:
    console.print(header)
    for rec in records:
        degree = rec["overlap_degree"]
        title = (
            f"cp {rec['cp']}: {'up to ' if rec['uneven_shard'] else ''}{rec['tokens_per_rank']:,} tokens per "
            f"rank{' (uneven shards)' if rec['uneven_shard'] else ''}, chunk {rec['chunk_size']}, "
            f"overlap degree {degree}, {rec['dispatch_alg']}, time imbalance {rec['time_imbalance']:.3f}, "
            f"area imbalance {rec['imbalance']:.3f} (lower bound {rec['lower_bound_imbalance']:.3f}), "
            f"planned in {rec['plan_seconds']:.2f} s"
        )
        groups = _column_groups(rec, console, wide)
        for n, cols in enumerate(groups):
            table = _scheme_table(rec, cols, title if n == 0 else None)
            if n != len(groups) - 1:
                table.caption = None  # the note on a skipped scheme once, under the last part
            if wide:  # the whole table, wider than the terminal if need be (the terminal then wraps lines)
                need = console.measure(table, options=console.options.update_width(1 << 16)).maximum
                width = console.width
                console.width = max(need, width)  # print(width=...) would clamp to the console's width
                console.print(table, crop=False)
                console.width = width
            else:
                console.print(table)
    console.print(
        "[dim]Predicted by magi-solver's overlap cost model, kernels by its kernel law where fitted (slowest "
        "rank; TF/s/GPU = FLOP / (time x cp)); time imbalance = (max fwd + max bwd) / (mean fwd + mean bwd) "
        "of the ranks' kernel times. "
        "vs magi = the scheme's fwd + bwd time over magi's. Ring and all-gather use zigzag shards; "
        "Ulysses needs both head counts divisible by cp.[/dim]"
    )


# cells a side of the whole-mask pictures (about one per pixel at 150 dpi and 7 inches)
_IMAGE_CELLS = 1000
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


def _write_plots(
    out_dir: str,
    q: Any,
    k: Any,
    t: Any,
    total: int,
    records: list[dict[str, Any]],
    plans: list[Any],
    scaling: list[dict[str, Any]],
) -> list[str]:
    from .tools import plot

    image = plot.mask_image(q, k, t, total, size=_IMAGE_CELLS)
    written = [plot.save_mask_png(os.path.join(out_dir, "mask.png"), image, "mask", total)]
    for rec, plan in zip(records, plans):
        cp = rec["cp"]
        padded = plan.dispatch.total_seqlen
        img = image if padded == total else plot.mask_image(q, k, t, padded, size=_IMAGE_CELLS)
        written.append(
            plot.save_dispatch_png(os.path.join(out_dir, f"dispatch_cp{cp}.png"), plan, img, mask=(q, k, t))
        )
        written.append(plot.save_rank_areas_png(os.path.join(out_dir, f"rank_areas_cp{cp}.png"), plan))
        written.append(plot.save_comm_matrix_png(os.path.join(out_dir, f"comm_matrix_cp{cp}.png"), plan))
    if len(scaling) > 1:
        written.append(plot.save_scaling_png(os.path.join(out_dir, "scaling.png"), scaling))
    return written


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
    cps = _int_list(args.cp, "--cp")
    if any(c < 1 for c in cps):
        raise CliError(f"--cp sizes must be >= 1, got {args.cp!r}")
    hw = _hardware(args)
    work = _workload(args)
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
    curve = scaling_cps(cps, total, smallest_chunk, _int_list(_DEFAULT_CP, "--cp")) if args.plot else cps
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
        written = _write_plots(args.plot, q, k, t, total, records, plans, scaling)
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        est = " (estimate)" if hw.estimate else ""
        header = (
            f"[bold]magi-attention-plan[/bold]: {desc}, {total:,} tokens, mask family {fam.value}; heads "
            f"{work.num_heads_q}:{work.num_heads_kv}, head_dim {work.head_dim}, {args.dtype}; hardware "
            f"{hw.name}{est}: {hw.source}"
        )
        _render(records, header, out, wide=args.wide)
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
