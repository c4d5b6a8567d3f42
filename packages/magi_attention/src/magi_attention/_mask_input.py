"""Normalisation of user mask arguments into plain tuples (the form keys hash and the planner takes).

Ranges may be lists of `[start, end]`, a `magi_solver.AttnRanges`, or an int tensor `[n, 2]`; mask types
may be an `AttnMaskType`, its name, its int code (0-3) or a list of those (one per slice, or one for all).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from magi_solver import AttnMaskType

Ranges = tuple[tuple[int, int], ...]


def normalize_ranges(ranges: Any, name: str) -> Ranges:
    """Return `ranges` as a tuple of `(start, end)` int pairs; raise naming `name` on bad input."""
    if isinstance(ranges, torch.Tensor):
        if ranges.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"{name} must be an integer tensor of shape [n, 2], got dtype {ranges.dtype}")
        if ranges.numel() == 0:
            return ()
        if ranges.ndim != 2 or ranges.shape[1] != 2:
            raise ValueError(f"{name} must have shape [n, 2], got {tuple(ranges.shape)}")
        return tuple((int(a), int(b)) for a, b in ranges.tolist())
    if not isinstance(ranges, Iterable) or isinstance(ranges, (str, bytes)):
        raise TypeError(
            f"{name} must be a list of [start, end] pairs, AttnRanges or an int tensor, got {ranges!r}"
        )
    out = []
    for i, r in enumerate(ranges):
        start, end = _range_bounds(r, f"{name}[{i}]")
        out.append((start, end))
    return tuple(out)


def _range_bounds(r: Any, name: str) -> tuple[int, int]:
    if hasattr(r, "start") and hasattr(r, "end") and not isinstance(r, range):
        pair: Sequence[Any] = (r.start, r.end)
    elif isinstance(r, range):
        pair = (r.start, r.stop)
    else:
        pair = r
    try:
        start, end = pair
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a [start, end] pair, got {r!r}") from None
    for v in (start, end):
        if isinstance(v, bool) or (not isinstance(v, (int,)) and not (hasattr(v, "__index__"))):
            raise TypeError(f"{name} bounds must be ints, got {r!r}")
    return int(start), int(end)


def normalize_mask_types(
    attn_mask_type: Any, num_slices: int, name: str = "attn_mask_type"
) -> tuple[int, ...]:
    """Return one int code per slice. A single type (not a list) applies to every slice."""
    if isinstance(attn_mask_type, torch.Tensor):
        attn_mask_type = attn_mask_type.tolist()
    if isinstance(attn_mask_type, (list, tuple)):
        if len(attn_mask_type) != num_slices:
            raise ValueError(
                f"{name} has {len(attn_mask_type)} entries but there are {num_slices} slices; "
                "give one type per slice or a single type for all"
            )
        return tuple(_mask_type_code(t, f"{name}[{i}]") for i, t in enumerate(attn_mask_type))
    code = _mask_type_code(attn_mask_type, name)
    return (code,) * num_slices


def _mask_type_code(t: Any, name: str) -> int:
    if isinstance(t, AttnMaskType):
        return int(t.value) if isinstance(t.value, int) else _code_from_name(t.name, name)
    if isinstance(t, bool):
        raise TypeError(f"{name} must be a mask type, got bool {t!r}")
    if isinstance(t, int):
        if t not in (0, 1, 2, 3):
            raise ValueError(
                f"{name} int code must be 0 (full), 1 (causal), 2 (inv_causal) or 3 (bi_causal), got {t}"
            )
        return t
    if isinstance(t, str):
        return _code_from_name(t, name)
    raise TypeError(f"{name} must be an AttnMaskType, a name or an int code, got {t!r}")


_NAMES = {"full": 0, "causal": 1, "inv_causal": 2, "invcausal": 2, "bi_causal": 3, "bicausal": 3}


def _code_from_name(s: str, name: str) -> int:
    key = s.strip().lower()
    if key not in _NAMES:
        raise ValueError(f"{name}: unknown mask type {s!r}; valid: full, causal, inv_causal, bi_causal")
    return _NAMES[key]
