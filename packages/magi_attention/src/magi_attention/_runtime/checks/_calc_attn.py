"""Every check of one `calc_attn` call, in one function: `validate_calc_attn` takes the call's arguments
and returns the call as it will run (`CalcAttnCall`), or raises on every rank of the cp group.

In order, on each rank, before any data moves:

1. the key's type (`_arguments.check_key`; a non-key names no group to tell, so it raises on this rank only);
2. inside the status agreement (`_call_agreement`), everything local: the runtime of the key (planned on a
   cache miss), q / k / v against the key (type, shape, this rank's shard, heads, head_dim, one dtype and
   device), the sinks (`magi_ffa`'s sink rules), the dtype, the scalars (softmax_scale, softcap), the kernel
   backend for this dtype, head_dim and softcap, and the dispatch tags of q, k, v (`_dispatch_tags`);
3. the agreement itself: a local failure on any rank raises on every rank, and so do values that differ
   across ranks (dtype, softmax_scale, softcap, whether max logits are reduced, whether there are sinks);
4. the plan's device tensors: rebuilt on every rank when any rank lacks them (that build is collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from magi_ffa._sink import validate_sink

from ...key import DistAttnRuntimeKey
from ..cache import RUNTIME_CACHE, DistAttnRuntime
from ._arguments import check_dtype, check_key, check_scalars
from ._call_agreement import agree_on_checked, build_device_meta_together, needs_device_meta
from ._dispatch_tags import check_dispatch_tags


@dataclass(frozen=True, slots=True)
class CalcAttnCall:
    """A `calc_attn` call that passed every check on every rank of its cp group."""

    runtime: DistAttnRuntime
    """The key's runtime (plan and kernel choice), its device tensors built for q's device."""
    softmax_scale: float
    """The scale of the scores (head_dim ** -0.5 when the caller passed None)."""
    softcap: float
    """0.0, or the cap of `softcap * tanh(scores / softcap)`."""
    sink: torch.Tensor | None
    """The caller's fp32 `[num_sink, num_heads_q]` sinks, or None."""
    return_max_logits: bool
    """Whether the call reduces the max logits (an all-reduce over the cp group)."""


def check_tensors(q, k, v, key: DistAttnRuntimeKey, runtime: DistAttnRuntime) -> None:
    """q, k, v against the key: tensors `[local_tokens, heads, head_dim]` of this rank's shard, the key's
    head counts and head_dim, one dtype, one device (the dtype itself: `check_dtype`, then the kernel
    backend's refinement, in `validate_calc_attn`)."""
    q_shard, kv_shard = runtime.local_seqlen, runtime.kv_local_seqlen
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise ValueError(f"{name} must be [local_tokens, heads, head_dim], got shape {tuple(t.shape)}")
        shard, how = (q_shard, "dispatch(x, key)") if name == "q" else (kv_shard, "dispatch_kv(x, key)")
        if t.shape[0] != shard:
            raise ValueError(
                f"{name} has {t.shape[0]} tokens but this rank's shard of the key has {shard}: "
                f"pass the dispatched (local) tensor, e.g. {how}"
            )
        if t.shape[2] != key.head_dim:
            raise ValueError(f"{name} head_dim is {t.shape[2]}, the key says {key.head_dim}")
    if q.shape[1] != key.num_heads_q:
        raise ValueError(f"q has {q.shape[1]} heads, the key says num_heads_q={key.num_heads_q}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[1] != key.num_heads_kv:
            raise ValueError(f"{name} has {t.shape[1]} heads, the key says num_heads_kv={key.num_heads_kv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def validate_calc_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: DistAttnRuntimeKey,
    softmax_scale: float | None,
    softcap: float,
    sink: torch.Tensor | None,
    return_max_logits: bool,
) -> CalcAttnCall:
    """The checked call of `calc_attn(q, k, v, key, softmax_scale, softcap, sink=sink,
    return_max_logits=return_max_logits)` (the module docstring lists the checks), agreed by every rank."""
    check_key(key)

    def check() -> CalcAttnCall:  # everything local, before the first collective of the call
        runtime = RUNTIME_CACHE.get(key)
        check_tensors(q, k, v, key, runtime)
        validate_sink(sink, q)
        check_dtype(q)
        scale, cap = check_scalars(softmax_scale, softcap, key.head_dim)
        runtime.kernel_choice.backend_for(q.dtype, key.head_dim, cap)  # e.g. a softcap its backend has not
        check_dispatch_tags(runtime, q=q, k=k, v=v)
        return CalcAttnCall(runtime, scale, cap, sink, bool(return_max_logits))

    # what every rank must pass alike: the dtype (the byte counts of every exchange), the scalars (else the
    # ranks compute different attentions), whether the max logits are reduced (an all-reduce) and sinks
    call, flags = agree_on_checked(
        key.cp_group,
        "calc_attn (forward)",
        check,
        same=lambda c: {
            "q.dtype": q.dtype,
            "softmax_scale": c.softmax_scale,
            "softcap": c.softcap,
            "return_max_logits": c.return_max_logits,
            "sink": c.sink is not None,
        },
        extra=lambda c: needs_device_meta(c.runtime, q.device),
    )
    build_device_meta_together(call.runtime, q.device, flags)
    return call
