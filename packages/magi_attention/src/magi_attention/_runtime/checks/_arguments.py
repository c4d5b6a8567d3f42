"""Per-call checks of `calc_attn` that need no communication: the key's type, the dtype, the scalars.

They run before the runtime's first collective of the call (and inside the sanity exchange, where every rank
also agrees on the dtype, softmax_scale and softcap). A bad value is caught here, on the rank that passed
it, instead of inside the kernel after the first GroupCast (where the other ranks would already wait).
"""

from __future__ import annotations

import torch

from magi_ffa.validation import validate_scalars

from ...key import DistAttnRuntimeKey

CALC_ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_key(key: object, name: str = "key") -> DistAttnRuntimeKey:
    if not isinstance(key, DistAttnRuntimeKey):
        raise TypeError(
            f"`{name}` must be a DistAttnRuntimeKey (from magi_attn_flex_key / magi_attn_varlen_key), "
            f"got {type(key).__name__}"
        )
    return key


def check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in CALC_ATTN_DTYPES:
        raise TypeError(f"q, k, v must be float16, bfloat16, float32 or float64, got {q.dtype}")


def check_scalars(softmax_scale: object, softcap: object, head_dim: int) -> tuple[float, float]:
    """(scale, softcap) as floats; ValueError naming the argument for bools, NaN, inf, negatives, non-numbers
    (the same rules as magi_ffa, so nothing the kernel would reject gets past the first collective)."""
    scale = validate_scalars(softmax_scale, softcap, head_dim)
    return scale, float(softcap)
