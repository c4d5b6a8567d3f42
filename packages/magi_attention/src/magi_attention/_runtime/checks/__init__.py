"""The failure checks of the public calls: what stops a bad call on every rank before any data moves, and
what names the rank, call and stage when a collective fails anyway.

- `_calc_attn`: every check of one `calc_attn` call in one function, `validate_calc_attn`, which returns the
  checked call (`CalcAttnCall`).
- `_arguments`: per-call checks that need no communication (the key's type, the dtype, the scalars).
- `_dispatch_tags`: the tag that catches tensors dispatched with one key and used with another.
- `_call_agreement`: the status agreement that opens every public collective call (one host-side exchange:
  a rank's local error, a different call or different values raise on every rank).
- `_key_agreement`: the key build as a collective (a new key's parts compared across ranks, before planning).
- `_comm_errors`: `CommError`, the error of a failed or timed-out collective, and `comm_step`, which raises it.
"""

from ._arguments import check_dtype, check_key, check_scalars
from ._calc_attn import CalcAttnCall, validate_calc_attn
from ._call_agreement import (
    agree_on_call,
    agree_on_checked,
    build_device_meta_together,
    check_plan_digests,
    needs_device_meta,
    tensor_values,
)
from ._comm_errors import CommError, comm_step
from ._dispatch_tags import check_dispatch_tags, tag_output
from ._key_agreement import agree_on_key, collective_key_build

__all__ = [
    "CalcAttnCall",
    "CommError",
    "agree_on_call",
    "agree_on_checked",
    "agree_on_key",
    "build_device_meta_together",
    "check_dispatch_tags",
    "check_dtype",
    "check_key",
    "check_plan_digests",
    "check_scalars",
    "collective_key_build",
    "comm_step",
    "needs_device_meta",
    "tag_output",
    "tensor_values",
    "validate_calc_attn",
]
