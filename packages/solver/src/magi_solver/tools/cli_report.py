"""What `magi-attention-plan` shows: per cp size a table of magi's plan against ring, all-gather and
Ulysses (split over several tables when the terminal is narrow, so that no number is cut), and with `--plot`
the PNGs of the mask, the dispatch, the rank areas, the communication and the scaling curve."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .predict import SCHEMES

__all__ = ["render_records", "write_plots"]

_SCHEME_LABEL = {
    "magi": "magi",
    "ring": "ring (zigzag)",
    "all_gather": "all-gather K/V",
    "ulysses": "Ulysses",
}


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


def render_records(records: list[dict[str, Any]], header: str, console: Any, wide: bool = False) -> None:
    """Print `header`, then per record (one cp size, `predict_cp`'s) its tables, then the legend, on the rich
    `console`; `wide`: one table per cp size whatever the terminal's width."""
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


def write_plots(
    out_dir: str,
    q: Any,
    k: Any,
    t: Any,
    total: int,
    records: list[dict[str, Any]],
    plans: list[Any],
    scaling: list[dict[str, Any]],
) -> list[str]:
    """The PNGs of `--plot` in `out_dir`: the mask (q, k, t over `total` tokens), per cp size (`records` and
    their `plans`) the dispatch, rank areas and communication matrix, and the scaling curve over the
    `scaling` records when there are several; returns the paths written."""
    from . import plot

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
