"""Pictures of masks and plans (PNG through matplotlib, the `magi-solver[plot]` extra).

`mask_image` is pure numpy (exact areas per cell, no dense mask); every `save_*` function imports
matplotlib on first use and raises `ImportError` naming the install row that brings it (`plot`) without it.
Images are downsampled to at most `size` x `size` cells, so a million-token mask draws in about a second
and a PNG stays small. Pictures are drawn at 150 dpi; the CLI's are 1000 px or more on the long side, and
its dispatch picture shows documents at a million tokens (one row per rank, and a zoom on the start).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..mask import band_area_np, normalize_mask, region_of
from ..plan import DistAttnPlan

__all__ = [
    "mask_image",
    "new_figure",
    "owner_image",
    "save_comm_matrix_png",
    "save_dispatch_png",
    "save_figure",
    "save_mask_png",
    "save_rank_areas_png",
    "save_scaling_png",
    "zoom_window",
]

# Names the row of the install table (docs/install.md) that brings the `plot` extra.
PLOT_INSTALL_HINT = 'install row "plot" (python scripts/install.py plot, docs/install.md)'
_DPI = 150
# The dispatch picture zooms on the first tokens: at least this many chunks, at least 1/16 of the sequence.
_ZOOM_MIN_CHUNKS = 8
_ZOOM_FRACTION = 16
# Document boundaries are drawn on the per-rank rows up to this many (beyond, they would fill the row).
_MAX_BOUNDARIES = 600


def new_figure(width: float, height: float) -> Any:
    """A matplotlib `Figure` (no pyplot state) of `width` x `height` inches at the pictures' resolution."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - exercised by the CLI test with matplotlib hidden
        raise ImportError(f"plots need matplotlib: {PLOT_INSTALL_HINT}") from e
    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def save_figure(fig: Any, path: str | os.PathLike[str]) -> str:
    """Write `fig` as an optimised PNG (parent folders created); returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=_DPI, pil_kwargs={"optimize": True})
    return path


def mask_image(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total: int,
    size: int = 256,
    window: tuple[int, int] | None = None,
) -> np.ndarray:
    """float64 `[n, n]`: the fraction of each cell's (q, k) pairs in the mask.

    The picture covers tokens `[lo, hi)` of both axes (`window`, default the whole `[0, total)`) in
    `n = min(size, hi - lo)` cells a side: cell `(i, j)` covers rows `[lo + i * (hi - lo) / n, ...)` and the
    same columns. Areas are exact (the slices are made disjoint first, then clipped to the window).
    """
    total = int(total)
    lo_w, hi_w = (0, total) if window is None else (int(window[0]), int(window[1]))
    if not 0 <= lo_w < hi_w <= total:
        raise ValueError(f"`window` must satisfy 0 <= lo < hi <= total = {total}, got {window}")
    n = max(1, min(int(size), hi_w - lo_w))
    edges = np.round(np.linspace(lo_w, hi_w, n + 1)).astype(np.int64)
    cell = np.diff(edges).astype(np.float64)
    img = np.zeros((n, n), dtype=np.float64)
    for s in normalize_mask(q_ranges, k_ranges, attn_mask_type, total, total):
        qs, qe, ks, ke, lo, hi = region_of(*s)
        # clip the bounding box to the window (lo/hi are diagonal offsets: clipping keeps them valid)
        qs, qe, ks, ke = max(qs, lo_w), min(qe, hi_w), max(ks, lo_w), min(ke, hi_w)
        if qs >= qe or ks >= ke:
            continue
        i0, i1 = np.searchsorted(edges, qs, "right") - 1, np.searchsorted(edges, qe, "left")
        j0, j1 = np.searchsorted(edges, ks, "right") - 1, np.searchsorted(edges, ke, "left")
        rq0 = np.maximum(edges[i0:i1], qs)[:, None]
        rq1 = np.minimum(edges[i0 + 1 : i1 + 1], qe)[:, None]
        rk0 = np.maximum(edges[j0:j1], ks)[None, :]
        rk1 = np.minimum(edges[j0 + 1 : j1 + 1], ke)[None, :]
        img[i0:i1, j0:j1] += band_area_np(rq0, rq1, rk0, rk1, lo, hi)
    return img / (cell[:, None] * cell[None, :])


def owner_image(plan: DistAttnPlan, n: int, window: tuple[int, int] | None = None) -> np.ndarray:
    """int `[n]`: the rank owning the middle token of each of `n` equal row cells of `window` (default the
    whole sequence)."""
    d = plan.dispatch
    lo, hi = (0, d.total_seqlen) if window is None else window
    edges = np.linspace(lo, hi, n + 1)
    mid = ((edges[:-1] + edges[1:]) / 2).astype(np.int64)
    return np.asarray(d.chunk_owner, dtype=np.int64)[np.minimum(mid // d.chunk_size, d.num_chunks - 1)]


def save_mask_png(
    path: str | os.PathLike[str],
    image: np.ndarray,
    title: str = "",
    total: int | None = None,
    inches: float = 7.0,
) -> str:
    """Write a mask image (`mask_image`) as a PNG: dark = attended, white = masked."""
    fig = new_figure(inches, inches)
    ax = fig.add_subplot()
    extent = None if total is None else (0, total, total, 0)
    ax.imshow(image, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest", extent=extent)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    return save_figure(fig, path)


def _rank_colors(cp: int) -> np.ndarray:
    from matplotlib import colormaps

    cmap = colormaps["tab20" if cp > 10 else "tab10"]
    return np.asarray([cmap(r % cmap.N) for r in range(cp)])


def _tinted(image: np.ndarray, owners: np.ndarray, colors: np.ndarray) -> np.ndarray:
    """RGB of a mask image whose every row is tinted by the colour of the rank owning it."""
    return 1.0 - image[:, :, None] * (1.0 - colors[owners][:, None, :3])


def zoom_window(plan: DistAttnPlan) -> tuple[int, int]:
    """The tokens the dispatch picture zooms on: the first `max(8 chunks, 1/16 of the sequence)`."""
    d = plan.dispatch
    want = max(_ZOOM_MIN_CHUNKS * d.chunk_size, d.total_seqlen // _ZOOM_FRACTION)
    want = -(-want // d.chunk_size) * d.chunk_size  # whole chunks
    return 0, min(d.total_seqlen, want)


def save_dispatch_png(
    path: str | os.PathLike[str],
    plan: DistAttnPlan,
    image: np.ndarray,
    title: str = "",
    mask: tuple[Any, Any, Any] | None = None,
) -> str:
    """Which rank owns which tokens: one row per rank along the sequence (with the document boundaries),
    the mask with every row tinted by its owner, and, given the `mask` (`q_ranges, k_ranges, types`)
    whose `image` this is, a zoom on the first tokens where single documents and chunks show."""
    d = plan.dispatch
    total, cp = d.total_seqlen, plan.cp_size
    colors = _rank_colors(cp)
    window = zoom_window(plan) if mask is not None else (0, total)
    zoom = mask is not None and window[1] < total
    fig = new_figure(11.0 if zoom else 7.0, 7.2)
    grid = fig.add_gridspec(2, 2 if zoom else 1, height_ratios=[1, 3.2])
    # one row per rank: a cell is coloured where the rank owns the tokens
    n = 1200
    owners = owner_image(plan, n)
    rows = np.ones((cp, n, 3))
    for r in range(cp):
        rows[r, owners == r] = colors[r, :3]
    strip = fig.add_subplot(grid[0, :])
    strip.imshow(rows, aspect="auto", interpolation="nearest", extent=(0, total, cp - 0.5, -0.5))
    if mask is not None:
        slices = normalize_mask(*mask, total, total, check_disjoint=False)
        starts = np.unique(np.asarray([sl[0] for sl in slices], dtype=np.int64))
        starts = starts[(starts > 0) & (starts < total)]
        if len(starts) <= _MAX_BOUNDARIES:
            strip.vlines(starts, -0.5, cp - 0.5, colors="0.6", lw=0.25)
    if zoom:
        strip.axvspan(*window, color="k", alpha=0.08, lw=0)
    strip.set_ylabel("rank")
    strip.set_yticks(range(cp) if cp <= 16 else range(0, cp, max(1, cp // 8)))
    strip.tick_params(labelsize=7)
    strip.set_title(
        title or f"dispatch over {cp} ranks: tokens each rank owns (grey lines: slice starts)", fontsize=9
    )
    main = fig.add_subplot(grid[1, 0])
    main.imshow(_tinted(image, owner_image(plan, image.shape[0]), colors), interpolation="nearest",
                extent=(0, total, total, 0))  # fmt: skip
    main.set_xlabel("key")
    main.set_ylabel("query (row colour = owning rank)")
    main.set_title("the whole mask", fontsize=9)
    main.tick_params(labelsize=7)
    if zoom:
        main.add_patch(_rectangle(window))
        zimg = mask_image(*mask, total, size=600, window=window)
        ax = fig.add_subplot(grid[1, 1])
        ax.imshow(_tinted(zimg, owner_image(plan, zimg.shape[0], window), colors), interpolation="nearest",
                  extent=(window[0], window[1], window[1], window[0]))  # fmt: skip
        ax.set_xlabel("key")
        ax.set_title(
            f"zoom: tokens {window[0]:,} to {window[1]:,} ({window[1] // d.chunk_size} chunks)", fontsize=9
        )
        ax.tick_params(labelsize=7)
    return save_figure(fig, path)


def _rectangle(window: tuple[int, int]) -> Any:
    from matplotlib.patches import Rectangle

    lo, hi = window
    return Rectangle((lo, lo), hi - lo, hi - lo, fill=False, ec="k", lw=0.8)


def save_rank_areas_png(path: str | os.PathLike[str], plan: DistAttnPlan, title: str = "") -> str:
    """Bars of each rank's mask area, with the mean and the balance lower bound."""
    areas = np.asarray(plan.rank_areas, dtype=np.float64)
    fig = new_figure(7.0, 4.0)
    ax = fig.add_subplot()
    ax.bar(np.arange(len(areas)), areas, color=_rank_colors(len(areas))[:, :3], width=0.9)
    ax.axhline(areas.mean(), color="k", lw=1, ls="--", label="mean")
    ax.axhline(plan.dispatch.lower_bound, color="tab:red", lw=1, ls=":", label="lower bound of the max")
    ax.set_xlabel("rank")
    ax.set_ylabel("mask area (q, k pairs)")
    ax.set_title(title or f"per-rank area, imbalance {plan.imbalance:.3f}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.tick_params(labelsize=7)
    return save_figure(fig, path)


def save_comm_matrix_png(path: str | os.PathLike[str], plan: DistAttnPlan, title: str = "") -> str:
    """Heat map of K/V tokens sent from rank (row) to rank (column), summed over the stages."""
    m = sum(plan.transfer_matrix(s) for s in range(plan.num_stages)).astype(np.float64)
    fig = new_figure(7.0, 5.8)
    ax = fig.add_subplot()
    im = ax.imshow(m, cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="K/V tokens", shrink=0.8)
    ax.set_xlabel("to rank")
    ax.set_ylabel("from rank")
    ax.set_title(title or f"K/V tokens between ranks, cp {plan.cp_size}", fontsize=9)
    ax.tick_params(labelsize=7)
    return save_figure(fig, path)


def save_scaling_png(
    path: str | os.PathLike[str],
    records: Sequence[dict[str, Any]],
    title: str = "",
    schemes: Sequence[str] = (),
) -> str:
    """Predicted forward and backward TFLOP/s per GPU against cp, one line per scheme (`predict_cp` records)."""
    names = list(schemes) or list(records[0]["schemes"])
    cps = [r["cp"] for r in records]
    fig = new_figure(8.0, 3.6)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, key, label in zip(axes, ("fwd_tflops_per_gpu", "bwd_tflops_per_gpu"), ("forward", "backward")):
        for name in names:
            ys = [r["schemes"][name].get(key, np.nan) for r in records]
            ax.plot(cps, ys, marker="o", ms=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cps, [str(c) for c in cps])
        ax.set_xlabel("cp (GPUs)")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("predicted TFLOP/s per GPU")
    axes[1].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
