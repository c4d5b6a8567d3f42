"""The input checks of the FFA API, for every package that offers the same contract (magi_ffa_fa4 uses them).

- :func:`as_ranges` / :func:`as_type_map`: ranges and types (tensors, lists, names) to int32 tensors.
- :func:`host_slices`: bound checks and the host slices, union-rewritten, cached by value.
- :func:`check_slices`: every check of the slice tables, once, as :class:`CheckedSlices` (for the internal
  launchers ``magi_ffa._ops.ffa_fwd_checked`` / ``ffa_bwd_checked`` of a caller that checks at plan time).
- :func:`slices_on_device` / :func:`check_slice_values`: the slice tables on one device, and their values
  checked (for the metadata builders of every backend).
- :func:`validate_qkv`, :func:`validate_scalars`, :func:`validate_out_lse`, :func:`validate_grad_buffers`,
  :func:`validate_bwd_inputs`, :func:`validate_dlse`:
  shapes, dtypes and devices of the tensors; :func:`acc_dtype`: the accumulator / lse dtype.
"""

from ._common import (
    CheckedSlices,
    RangesLike,
    TypeMapLike,
    acc_dtype,
    as_ranges,
    as_type_map,
    check_slice_values,
    host_slices,
    slices_on_device,
    validate_bwd_inputs,
    validate_dlse,
    validate_grad_buffers,
    validate_out_lse,
    validate_qkv,
    validate_scalars,
)
from .mask_cache import check_slices

__all__ = [
    "CheckedSlices",
    "RangesLike",
    "TypeMapLike",
    "acc_dtype",
    "as_ranges",
    "as_type_map",
    "check_slice_values",
    "check_slices",
    "host_slices",
    "slices_on_device",
    "validate_bwd_inputs",
    "validate_dlse",
    "validate_grad_buffers",
    "validate_out_lse",
    "validate_qkv",
    "validate_scalars",
]
