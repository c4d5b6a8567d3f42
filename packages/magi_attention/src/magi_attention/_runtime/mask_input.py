"""Normalisation of user mask arguments into plain tuples (the form keys hash and the planner takes).

Ranges may be lists of `[start, end]`, a `magi_solver.AttnRanges`, or an int tensor `[n, 2]`; mask types
may be an `AttnMaskType`, its name, its int code (0-3) or a list of those (one per slice, or one for all).
"""

from __future__ import annotations

from typing import Any

import torch
from magi_mask import as_int_pairs, normalize_types

Ranges = tuple[tuple[int, int], ...]


def normalize_ranges(ranges: Any, name: str) -> Ranges:
    """Return `ranges` as a tuple of `(start, end)` int pairs; raise naming `name` on bad input.

    Int tensors are checked here (dtype, shape); everything else is `magi_mask.as_int_pairs`.
    """
    if isinstance(ranges, torch.Tensor):
        if ranges.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"{name} must be an integer tensor of shape [n, 2], got dtype {ranges.dtype}")
        if ranges.numel() == 0:
            return ()
        if ranges.ndim != 2 or ranges.shape[1] != 2:
            raise ValueError(f"{name} must have shape [n, 2], got {tuple(ranges.shape)}")
    return tuple(as_int_pairs(ranges, name))


def normalize_mask_types(
    attn_mask_type: Any, num_slices: int, name: str = "attn_mask_type"
) -> tuple[int, ...]:
    """Return one int code per slice. A single type (not a list) applies to every slice
    (`magi_mask.normalize_types`: members, names in any case, int codes; tensors are read as lists)."""
    if isinstance(attn_mask_type, torch.Tensor):
        attn_mask_type = attn_mask_type.tolist()
    return tuple(normalize_types(attn_mask_type, num_slices, name))
