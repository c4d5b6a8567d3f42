"""Pictures of masks and plans (PNG through matplotlib, the `magi-solver[plot]` extra).

`mask_image` is pure numpy (exact areas per cell, no dense mask); every `save_*` function imports
matplotlib on first use and raises `ImportError` naming the install row that brings it (`plot`) without it.
Images are downsampled to at most `size` x `size` cells, so a million-token mask draws in well under a
second and a PNG stays small.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .mask import band_area_np, normalize_mask, region_of
from .plan import DistAttnPlan

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
]

# Names the row of the install table (docs/install.md) that brings the `plot` extra.
PLOT_INSTALL_HINT = 'install row "plot" (python scripts/install.py plot, docs/install.md)'
_DPI = 80


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


def mask_image(q_ranges: Any, k_ranges: Any, attn_mask_type: Any, total: int, size: int = 256) -> np.ndarray:
    """float64 `[n, n]`, `n = min(size, total)`: the fraction of each cell's (q, k) pairs in the mask.

    Cell `(i, j)` covers rows `[i * total / n, (i + 1) * total / n)` and the same columns; areas are exact
    (the slices are made disjoint first).
    """
    total = int(total)
    n = max(1, min(int(size), total))
    edges = np.round(np.linspace(0, total, n + 1)).astype(np.int64)
    cell = np.diff(edges).astype(np.float64)
    img = np.zeros((n, n), dtype=np.float64)
    for s in normalize_mask(q_ranges, k_ranges, attn_mask_type, total, total):
        qs, qe, ks, ke, lo, hi = region_of(*s)
        i0, i1 = np.searchsorted(edges, qs, "right") - 1, np.searchsorted(edges, qe, "left")
        j0, j1 = np.searchsorted(edges, ks, "right") - 1, np.searchsorted(edges, ke, "left")
        rq0 = np.maximum(edges[i0:i1], qs)[:, None]
        rq1 = np.minimum(edges[i0 + 1 : i1 + 1], qe)[:, None]
        rk0 = np.maximum(edges[j0:j1], ks)[None, :]
        rk1 = np.minimum(edges[j0 + 1 : j1 + 1], ke)[None, :]
        img[i0:i1, j0:j1] += band_area_np(rq0, rq1, rk0, rk1, lo, hi)
    return img / (cell[:, None] * cell[None, :])


def owner_image(plan: DistAttnPlan, n: int) -> np.ndarray:
    """int `[n]`: the rank owning the middle token of each of `n` equal row cells."""
    d = plan.dispatch
    edges = np.linspace(0, d.total_seqlen, n + 1)
    mid = ((edges[:-1] + edges[1:]) / 2).astype(np.int64)
    return np.asarray(d.chunk_owner, dtype=np.int64)[np.minimum(mid // d.chunk_size, d.num_chunks - 1)]


def save_mask_png(
    path: str | os.PathLike[str],
    image: np.ndarray,
    title: str = "",
    total: int | None = None,
    inches: float = 3.0,
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


def save_dispatch_png(
    path: str | os.PathLike[str], plan: DistAttnPlan, image: np.ndarray, title: str = ""
) -> str:
    """The mask with every row tinted by the rank that owns it, and a strip of chunk owners above it."""
    n = image.shape[0]
    owners = owner_image(plan, n)
    colors = _rank_colors(plan.cp_size)
    rgb = 1.0 - image[:, :, None] * (1.0 - colors[owners][:, None, :3])
    fig = new_figure(3.4, 3.8)
    top, main = fig.subplots(2, 1, height_ratios=[1, 12])
    strip = colors[owners][None, :, :3]
    top.imshow(strip, aspect="auto", interpolation="nearest")
    top.set_axis_off()
    top.set_title(title or f"dispatch over {plan.cp_size} ranks (colour = owner)", fontsize=9)
    total = plan.dispatch.total_seqlen
    main.imshow(rgb, interpolation="nearest", extent=(0, total, total, 0))
    main.set_xlabel("key")
    main.set_ylabel("query (row colour = owning rank)")
    main.tick_params(labelsize=7)
    return save_figure(fig, path)


def save_rank_areas_png(path: str | os.PathLike[str], plan: DistAttnPlan, title: str = "") -> str:
    """Bars of each rank's mask area, with the mean and the balance lower bound."""
    areas = np.asarray(plan.rank_areas, dtype=np.float64)
    fig = new_figure(4.0, 2.6)
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
    fig = new_figure(3.6, 3.0)
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
    fig = new_figure(6.0, 2.6)
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
