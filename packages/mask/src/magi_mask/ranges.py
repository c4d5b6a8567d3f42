"""Normalisation of pure-Python range inputs: int pairs in, bound checks, typed slices out.

Torch tensors are converted by the torch packages (device, dtype and shape checks are theirs); anything
with `.tolist()` is read here as nested lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .types import normalize_types

__all__ = ["TypedSlice", "as_int_pairs", "check_int", "validate_slices"]

TypedSlice = tuple[int, int, int, int, int]  # (qs, qe, ks, ke, type code)


def check_int(value: Any, name: str) -> int:
    """`value` as an int; TypeError for non-ints and bools (True as a token index is always a bug)."""
    if type(value) is int:  # the common case first (a bool's type is bool, never int): millions per mask
        return value
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}")
    return int(value.__index__())


def as_int_pairs(ranges: Any, name: str) -> list[tuple[int, int]]:
    """Read `ranges` as `(start, end)` int pairs.

    Accepts `[[s, e], ...]`, an `[n, 2]` array (anything with `.tolist()`), a collection with
    `.to_tuples()` (magi_solver's `AttnRanges`), and items with `.start` / `.end` (an `AttnRange`) or
    Python `range`s. Only the shape and int-ness are checked; bounds are `validate_slices`' business.
    """
    if hasattr(ranges, "to_tuples"):
        ranges = ranges.to_tuples()
    elif hasattr(ranges, "tolist") and not isinstance(ranges, (list, tuple)):
        ranges = ranges.tolist()
    if not isinstance(ranges, Iterable) or isinstance(ranges, (str, bytes)):
        raise TypeError(
            f"`{name}` must be a list of [start, end] pairs, AttnRanges or an int tensor, "
            f"got {type(ranges).__name__}"
        )
    out: list[tuple[int, int]] = []
    for i, item in enumerate(ranges):
        if isinstance(item, range):
            item = (item.start, item.stop)
        elif hasattr(item, "start") and hasattr(item, "end"):
            item = (item.start, item.end)
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            raise ValueError(f"`{name}[{i}]` must be a [start, end] pair, got {item!r}")
        out.append((check_int(item[0], f"{name}[{i}][0]"), check_int(item[1], f"{name}[{i}][1]")))
    return out


def validate_slices(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_q: int,
    total_k: int,
    *,
    allow_empty: bool = False,
    type_name: str = "attn_mask_type",
) -> list[TypedSlice]:
    """Check a mask and return it as `(qs, qe, ks, ke, code)` tuples in input order.

    Raises ValueError naming the offending slice for ranges outside `[0, total)`, negative ranges, empty
    ranges (unless `allow_empty`), unknown types and a type list of the wrong length.
    """
    qp = as_int_pairs(q_ranges, "q_ranges")
    kp = as_int_pairs(k_ranges, "k_ranges")
    if len(qp) != len(kp):
        raise ValueError(
            f"`q_ranges` and `k_ranges` must have the same length (the same number of slices), "
            f"got {len(qp)} and {len(kp)}"
        )
    types = normalize_types(attn_mask_type, len(qp), type_name)
    out: list[TypedSlice] = []
    for i, ((qs, qe), (ks, ke), t) in enumerate(zip(qp, kp, types)):
        for name, s, e, total in (("q_ranges", qs, qe, total_q), ("k_ranges", ks, ke, total_k)):
            if s > e or (s == e and not allow_empty):
                need = "start <= end" if allow_empty else "start < end"
                raise ValueError(f"`{name}[{i}]` = [{s}, {e}) is empty or negative; slices need {need}")
            if s < 0 or e > total:
                raise ValueError(f"`{name}[{i}]` = [{s}, {e}) lies outside the sequence [0, {total})")
        out.append((qs, qe, ks, ke, t))
    return out
