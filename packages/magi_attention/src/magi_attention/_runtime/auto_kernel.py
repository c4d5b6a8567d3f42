"""`kernel_backend="auto"` refined by the shipped table of measured kernel times (`magi_solver.kernel_choice`).

The table's rows name the backends they measured; the candidates come from the agreement
(`kernels.KernelChoice.candidates`), so nothing here names a backend either. Without a table for rank 0's GPU
kind (or a row for the head_dim) the capabilities' priority order stays, and the reason says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from magi_solver.kernel_choice import MaskFeatures, load_kernel_table, pick_kernel

from .kernels import AUTO, KernelChoice, backend_name


def choose_auto(
    choice: KernelChoice,
    head_dim: int,
    features: Callable[[], MaskFeatures],
    *,
    deterministic: bool = False,
) -> KernelChoice:
    """`auto` refined by the shipped table of rank 0's GPU kind: the candidate with the smallest measured
    forward + backward time on the nearest measured row, possibly a forward on one backend and a backward on
    another. `features` is called only when a table measured two candidates; it must return the same value on
    every rank (it is computed from the global mask and the dispatch). `deterministic`: the table's
    deterministic rows (`pick_kernel(deterministic=True)`); the candidates are those `choice` keeps (after
    `kernels.restrict_deterministic`). Explicit choices, and groups without a GPU on every rank, are kept."""
    if choice.requested != AUTO or not choice.on_gpu:
        return choice
    table = load_kernel_table(choice.gpu_kind)
    if table is None:
        reason = f"auto: no measured kernel table for GPU kind {choice.gpu_kind!r}; the capability rule ({choice.reason})"
        return dataclasses.replace(choice, reason=reason)
    measured = {name for row in table.rows for name in row["ms"]}
    candidates = [name for name in choice.candidates if name in measured]
    if len(candidates) < 2:
        return choice
    picked = pick_kernel(table, features(), head_dim, candidates, deterministic=deterministic)
    if picked is None:
        reason = f"auto: the {choice.gpu_kind} table has no row for head_dim {head_dim}; the capability rule"
        return dataclasses.replace(choice, reason=f"{reason} ({choice.reason})")
    forward, backward = backend_name(picked.forward), backend_name(picked.backward)
    return dataclasses.replace(
        choice,
        backend=forward,
        backward=backward if backward != forward else None,
        reason=f"auto: {picked.reason}",
    )
