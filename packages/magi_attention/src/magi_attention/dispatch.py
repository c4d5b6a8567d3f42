"""dispatch / undispatch: move a global token tensor to the ranks' chunks and back, with autograd.
Part of the product (`api`, `dispatch`, `dist_attn`, `config`); `magi_attention.api` re-exports its calls.

`dispatch(x, key)` pads `x` (tokens on dim 0) to the planned length and keeps this rank's chunks, in
ascending chunk order. Its backward all-gathers the local gradients, so every rank receives the full
gradient of `x` (x is replicated on every rank). `undispatch(local_x, key)` all-gathers the shards and
restores global order (padding removed); its backward keeps the local part of the gradient.

With `DispatchConfig(uneven_shard=True)` nothing is padded and ranks hold different token counts: the
all-gathers pad each rank's rows to the largest shard on the wire only, and the gather index skips them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._runtime.cache import RUNTIME_CACHE, DistAttnRuntime
from ._runtime.checks import (
    agree_on_call,
    check_dispatch_tags,
    check_key,
    check_plan_digests,
    tag_output,
    tensor_values,
)
from ._runtime.comm import all_gather_tokens
from ._runtime.compile_break import graph_break
from .key import DistAttnRuntimeKey


def _pad_tokens(x: torch.Tensor, padded: int, pad_value: float = 0.0) -> torch.Tensor:
    if x.shape[0] == padded:
        return x
    return torch.cat([x, x.new_full((padded - x.shape[0], *x.shape[1:]), pad_value)], dim=0)


def _gather_global(local: torch.Tensor, runtime: DistAttnRuntime) -> torch.Tensor:
    """Local shards of every rank -> the global tensor in original token order (padding removed)."""
    layout = runtime.layout
    unpermutation = runtime.unpermutation(local.device)
    group = runtime.key.cp_group.group
    gathered = all_gather_tokens(local, group, layout.cp_size, layout.shard_seqlen)
    return gathered.index_select(0, unpermutation[: layout.total_seqlen])


def _select_local(x: torch.Tensor, runtime: DistAttnRuntime, pad_value: float = 0.0) -> torch.Tensor:
    local_ids = runtime.local_ids(x.device)
    return _pad_tokens(x, runtime.layout.padded_seqlen, pad_value).index_select(0, local_ids)


class DispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, runtime: DistAttnRuntime, pad_value: float) -> torch.Tensor:
        ctx.runtime = runtime
        return _select_local(x, runtime, pad_value)

    @staticmethod
    def backward(ctx, grad_local: torch.Tensor):
        _agree_on_backward(ctx.runtime, "dispatch (backward)", grad_local, DistAttnRuntime.unpermutation)
        return _gather_global(grad_local, ctx.runtime), None, None


def _agree_on_backward(runtime: DistAttnRuntime, call: str, grad: torch.Tensor, tokens=None) -> None:
    """Every rank runs this backward (a rank that skipped it, or is elsewhere, is named, not awaited);
    `tokens`: the token indices it reads (`DistAttnRuntime.unpermutation`), built inside the check (local: a
    failure there raises on every rank)."""
    agree_on_call(
        runtime.key.cp_group,
        call,
        (lambda: None) if tokens is None else (lambda: tokens(runtime, grad.device)),
        same=lambda: tensor_values(grad, "grad"),
    )


class UndispatchFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_x: torch.Tensor, runtime: DistAttnRuntime) -> torch.Tensor:
        ctx.runtime = runtime
        return _gather_global(local_x, runtime)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        return _select_local(grad_x, ctx.runtime), None


def _check_pad_value(pad_value: object) -> None:
    if isinstance(pad_value, bool) or not isinstance(pad_value, int | float):
        raise TypeError(f"pad_value must be an int or float, got {type(pad_value).__name__}")


def _agree_on_tokens(
    key: DistAttnRuntimeKey,
    call: str,
    x: object,
    check,
    same: dict | None = None,
    *,
    tokens: Callable[[DistAttnRuntime, torch.device], torch.Tensor] | None = None,
) -> DistAttnRuntime:
    """The runtime of `key` after the status agreement of `call` on a token tensor `x`: `check` runs
    locally, then every rank agrees (dtype and trailing shape of `x`, the values of `same`); raises on every
    rank if any failed. With `tokens` (`DistAttnRuntime.local_ids` or `.unpermutation`), the token indices
    the call reads are built on x's device inside the check (a local build: a failure there is agreed like
    a bad argument) and every rank's `plan_digest` is compared (ranks that planned the key differently
    raise before any token moves)."""
    got: list[DistAttnRuntime] = []

    def local() -> None:
        got.append(RUNTIME_CACHE.get(key))
        check()
        if tokens is not None and key.cp_size > 1:
            tokens(got[0], x.device)

    flags = agree_on_call(
        key.cp_group,
        call,
        local,
        same=lambda: {**tensor_values(x, "x" if call.startswith("dispatch") else "local_x"), **(same or {})},
        extra=lambda: [got[0].plan_digest] if tokens is not None else [],
    )
    if tokens is not None:
        check_plan_digests([f[0] for f in flags if f])
    return got[0]


def _check_tokens(x: torch.Tensor, expected: int, name: str, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[0] != expected:
        got = tuple(x.shape)
        raise ValueError(f"{name} must have {expected} tokens on dim 0 ({what}), got shape {got}")


@graph_break  # torch.compile: one graph break per call (docs/packages/magi_attention.md)
def dispatch(x: torch.Tensor, key: DistAttnRuntimeKey, pad_value: float = 0.0) -> torch.Tensor:
    """Keep this rank's tokens of the global tensor `x`.

    Args:
        x: `[total_seqlen_q, ...]`, the same on every rank of the key's cp group (tokens on dim 0, any
            trailing shape and dtype).
        key: from `magi_attn_flex_key` / `magi_attn_varlen_key`.
        pad_value: the value of the padding rows (e.g. -100 for labels); padding rows see no key.

    Returns:
        `[key.shard_seqlen, ...]`: this rank's chunks (ascending chunk id); with
        `DispatchConfig(uneven_shard=True)` ranks hold different counts (`key.shard_seqlens`).
    """
    check_key(key)  # a non-key names no group to tell: it raises here, on this rank only
    runtime = _agree_on_tokens(
        key,
        "dispatch",
        x,
        lambda: (
            _check_tokens(x, key.total_seqlen_q, "x", "the key's total_seqlen_q"),
            _check_pad_value(pad_value),
        ),
        {"pad_value": float(pad_value) if isinstance(pad_value, int | float) else 0.0},
        tokens=DistAttnRuntime.local_ids,
    )
    if key.cp_size == 1:
        return x
    pad = float(pad_value) if x.is_floating_point() else int(pad_value)
    return tag_output(DispatchFunction.apply(x, runtime, pad), runtime)


@graph_break  # torch.compile: one graph break per call
def undispatch(local_x: torch.Tensor, key: DistAttnRuntimeKey) -> torch.Tensor:
    """Gather every rank's shard back into the global tensor (padding removed).

    Args:
        local_x: `[key.shard_seqlen, ...]`, this rank's tokens (e.g. the output of `calc_attn`, or its lse).
        key: the key the tensors were dispatched with.

    Returns:
        `[total_seqlen_q, ...]` in global token order, the same on every rank.
    """
    check_key(key)
    runtime = RUNTIME_CACHE.get(key)
    _agree_on_tokens(
        key,
        "undispatch",
        local_x,
        lambda: (
            _check_tokens(local_x, runtime.local_seqlen, "local_x", "this rank's shard of the key"),
            check_dispatch_tags(runtime, local_x=local_x),
        ),
        tokens=DistAttnRuntime.unpermutation,
    )
    if key.cp_size == 1:
        return local_x
    return UndispatchFunction.apply(local_x, runtime)


# -- the key/value side of cross-attention ------------------------------------------------------------------
def _kv_shard(x: torch.Tensor, runtime: DistAttnRuntime) -> torch.Tensor:
    kv = runtime.layout.kv_layout
    padded = _pad_tokens(x, kv.total_seqlen)
    ((start, end),) = kv.host_pairs(runtime.rank)
    return padded[start:end]


def _kv_gather(local: torch.Tensor, runtime: DistAttnRuntime) -> torch.Tensor:
    kv = runtime.layout.kv_layout
    if not kv.uneven_shard:
        gathered = all_gather_tokens(local, runtime.key.cp_group.group, runtime.layout.cp_size)
        return gathered[: runtime.layout.kv_total_seqlen]
    # uneven shards: rank r's rows arrive at r * rows, padded to the largest shard
    rows = kv.shard_seqlen
    gathered = all_gather_tokens(local, runtime.key.cp_group.group, runtime.layout.cp_size, rows)
    return torch.cat([gathered[r * rows : r * rows + n] for r, n in enumerate(kv.shard_seqlens)], dim=0)


class DispatchKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, runtime: DistAttnRuntime) -> torch.Tensor:
        ctx.runtime = runtime
        return _kv_shard(x, runtime).contiguous()

    @staticmethod
    def backward(ctx, grad_local: torch.Tensor):
        _agree_on_backward(ctx.runtime, "dispatch_kv (backward)", grad_local)
        return _kv_gather(grad_local.contiguous(), ctx.runtime), None


class UndispatchKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_x: torch.Tensor, runtime: DistAttnRuntime) -> torch.Tensor:
        ctx.runtime = runtime
        return _kv_gather(local_x.contiguous(), runtime)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        return _kv_shard(grad_x, ctx.runtime).contiguous(), None


@graph_break  # torch.compile: one graph break per call
def dispatch_kv(x: torch.Tensor, key: DistAttnRuntimeKey) -> torch.Tensor:
    """Keep this rank's shard of a key/value-side tensor (cross-attention: keys and values from another
    sequence than the queries). For a self-attention key this is `dispatch(x, key)`.

    Args:
        x: `[total_seqlen_k, ...]`, the same on every rank (tokens on dim 0).
        key: a key from `magi_attn_flex_key` / `magi_attn_varlen_key`.

    Returns:
        `[key.kv_shard_seqlen, ...]`: rank r holds key tokens `[r * kv_shard, (r + 1) * kv_shard)` of the
        padded sequence (contiguous equal shards; padding rows are zero and no query sees them); with
        `DispatchConfig(uneven_shard=True)`, contiguous unpadded shards of `key.kv_shard_seqlens` tokens.
        Backward: every rank receives the full gradient of `x`.
    """
    if not check_key(key).is_cross_attention:
        return dispatch(x, key)
    runtime = _agree_on_tokens(
        key,
        "dispatch_kv",
        x,
        lambda: _check_tokens(x, key.total_seqlen_k, "x", "the key's total_seqlen_k"),
    )
    if key.cp_size == 1:
        return x
    return DispatchKVFunction.apply(x, runtime)


@graph_break  # torch.compile: one graph break per call
def undispatch_kv(local_x: torch.Tensor, key: DistAttnRuntimeKey) -> torch.Tensor:
    """Gather every rank's key/value shard back into the global `[total_seqlen_k, ...]` tensor (padding
    removed); for a self-attention key this is `undispatch(local_x, key)`.

    Args:
        local_x: `[key.kv_shard_seqlen, ...]`, this rank's key/value-side tokens (e.g. a dK / dV shard).
        key: the key the tensors were dispatched with.
    """
    if not check_key(key).is_cross_attention:
        return undispatch(local_x, key)
    runtime = RUNTIME_CACHE.get(key)
    _agree_on_tokens(
        key,
        "undispatch_kv",
        local_x,
        lambda: _check_tokens(
            local_x, runtime.kv_local_seqlen, "local_x", "this rank's key/value shard of the key"
        ),
    )
    if key.cp_size == 1:
        return local_x
    return UndispatchKVFunction.apply(local_x, runtime)
