"""Public API, compatible with MagiAttention's names: the front door of the product (`api`, `dispatch`,
`dist_attn`, `config`; `import magi_attention` hands on this module's `__all__` and the config's).

Typical flow::

    key = magi_attn_flex_key(q_ranges, k_ranges, types, total, total, hq, hkv, d, cp_group)
    local_x = dispatch(x, key)                       # this rank's tokens
    q, k, v = project(local_x)                       # [shard, heads, d]
    out, meta = calc_attn(q, k, v, key)              # distributed attention
    y = undispatch(out, key)                         # global order again (or keep working locally)

Position-dependent code (RoPE) must use `get_position_ids(key)`: dispatch permutes tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from magi_group_collective import as_device_mesh
from magi_solver import (
    AttnMaskType,
    AttnRanges,
    DispatchChoice,
    PreparedDispatch,
    adopt_dispatch,
    make_sliding_window_mask,
)

from ._layout import solve_dispatch_ahead
from ._runtime.cache import RUNTIME_CACHE
from ._runtime.checks import CommError, agree_on_call, agree_on_key, collective_key_build
from ._runtime.checks._arguments import CALC_ATTN_DTYPES
from ._runtime.collective_choice import choose_collective
from ._runtime.mask_input import normalize_mask_types, normalize_ranges
from .config import DistAttnConfig, KernelBackend, OverlapMode
from .dispatch import dispatch, dispatch_kv, undispatch, undispatch_kv
from .dist_attn import AttnForwardMeta, calc_attn
from .helpers import (
    compute_pad_size,
    cu_seqlens_list,
    infer_attn_mask_from_cu_seqlens,
    infer_attn_mask_from_sliding_window,
    infer_varlen_mask_from_batch,
    squash_batch_dim,
)
from .key import CpGroup, DistAttnRuntimeKey
from .mask_mod import infer_attn_mask_from_mask_mod
from .roll import roll

AttnOverlapMode = OverlapMode
"""MagiAttention's name of `magi_attention.config.OverlapMode`."""

__all__ = [
    "AttnForwardMeta",
    "AttnMaskType",
    "AttnOverlapMode",
    "AttnRanges",
    "CommError",
    "DispatchChoice",
    "DistAttnRuntimeKey",
    "PreparedDispatch",
    "adopt_dispatch",
    "calc_attn",
    "clear_cache",
    "compute_pad_size",
    "dispatch",
    "dispatch_kv",
    "get_dispatch_choice",
    "get_kernel_backend",
    "get_most_recent_key",
    "get_position_ids",
    "infer_attn_mask_from_cu_seqlens",
    "infer_attn_mask_from_mask_mod",
    "infer_attn_mask_from_sliding_window",
    "infer_varlen_mask_from_batch",
    "magi_attn_flex_key",
    "magi_attn_varlen_key",
    "make_flex_key_for_new_mask_after_dispatch",
    "make_varlen_key_for_new_mask_after_dispatch",
    "prepare_flex_dispatch",
    "prepare_varlen_dispatch",
    "roll",
    "squash_batch_dim",
    "undispatch",
    "undispatch_kv",
    "warmup",
]


def _resolve_cp_group(cp_group_or_mesh: Any) -> CpGroup:
    if cp_group_or_mesh is None:
        if not dist.is_available() or not dist.is_initialized():
            return CpGroup(name="<single-process>", ranks=(0,))
        cp_group_or_mesh = dist.group.WORLD
    if cp_group_or_mesh is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"cp_group_or_mesh: this process (global rank {dist.get_rank()}) is not in the given group: "
            "the key was built for another group"
        )
    mesh = as_device_mesh(cp_group_or_mesh, "cp_group_or_mesh")
    if mesh is not None:
        if mesh.ndim == 1:
            return _group_of(mesh.get_group())
        flat = _group_of(mesh._flatten().get_group())
        return CpGroup(flat.name, flat.ranks, tuple(mesh.shape), flat.group, mesh)
    if isinstance(cp_group_or_mesh, dist.ProcessGroup):
        return _group_of(cp_group_or_mesh)
    raise TypeError(
        f"cp_group_or_mesh must be a ProcessGroup, a DeviceMesh or None, got {type(cp_group_or_mesh).__name__}"
    )


def _group_of(group: dist.ProcessGroup) -> CpGroup:
    ranks = tuple(dist.get_process_group_ranks(group))
    return CpGroup(name=group.group_name, ranks=ranks, group=group)


def _cp_group_arg(bound) -> CpGroup:  # the cp group a failed key build reports its error to
    return _resolve_cp_group(bound.arguments["cp_group_or_mesh"])


def _dispatch_key_group(bound) -> CpGroup:
    return bound.arguments["key_for_dispatch"].cp_group


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_mask_bounds(q_ranges, k_ranges, total_q: int, total_k: int) -> None:
    if len(q_ranges) != len(k_ranges):
        raise ValueError(f"q_ranges has {len(q_ranges)} slices but k_ranges has {len(k_ranges)}")
    for name, ranges, total in (("q_ranges", q_ranges, total_q), ("k_ranges", k_ranges, total_k)):
        for i, (s, e) in enumerate(ranges):
            if not 0 <= s <= e <= total:
                raise ValueError(f"{name}[{i}] = [{s}, {e}) must satisfy 0 <= start <= end <= {total}")


def _drop_empty_slices(q_ranges, k_ranges, types):
    """Slices with an empty q or k range hold no pair: drop them (the planner rejects empty ranges)."""
    keep = [i for i, ((qs, qe), (ks, ke)) in enumerate(zip(q_ranges, k_ranges)) if qs < qe and ks < ke]
    return tuple(q_ranges[i] for i in keep), tuple(k_ranges[i] for i in keep), tuple(types[i] for i in keep)


def _flex_mask(q_ranges, k_ranges, attn_mask_type, total_seqlen_q, total_seqlen_k) -> tuple:
    """The mask a key holds: `(q_ranges, k_ranges, types, total_q, total_k)`, checked, empty slices dropped."""
    q = normalize_ranges(q_ranges, "q_ranges")
    k = normalize_ranges(k_ranges, "k_ranges")
    types = normalize_mask_types(attn_mask_type, len(q))
    total_q = _positive_int(total_seqlen_q, "total_seqlen_q")
    total_k = _positive_int(total_seqlen_k, "total_seqlen_k")
    _check_mask_bounds(q, k, total_q, total_k)
    return (*_drop_empty_slices(q, k, types), total_q, total_k)


def _varlen_mask(cu_seqlens_q, cu_seqlens_k, causal: bool, window_size) -> tuple:
    """The packed-documents mask `magi_attn_varlen_key` builds: `(q_ranges, k_ranges, types, total_q,
    total_k)` as `magi_attn_flex_key` takes them."""
    cu_q = cu_seqlens_list(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_seqlens_list(cu_seqlens_k, "cu_seqlens_k")
    window = _window_pair(window_size, causal)
    if cu_q == cu_k:
        mask = make_sliding_window_mask(cu_q, window)
        return mask.q_ranges, mask.k_ranges, mask.types, cu_q[-1], cu_k[-1]
    # cross-attention between documents: query document i sees key document i
    q_ranges, k_ranges, types, _, _ = infer_attn_mask_from_cu_seqlens(cu_q, cu_k, causal, window_size)
    return q_ranges, k_ranges, types, cu_q[-1], cu_k[-1]


def _key_config(dist_attn_config: Any, chunk_size: int | None) -> DistAttnConfig:
    config = DistAttnConfig() if dist_attn_config is None else dist_attn_config
    if not isinstance(config, DistAttnConfig):
        raise TypeError(f"dist_attn_config must be a DistAttnConfig, got {type(config).__name__}")
    return _with_chunk_size(config, chunk_size)


@collective_key_build(_cp_group_arg)
def magi_attn_flex_key(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen_q: int,
    total_seqlen_k: int,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group_or_mesh: Any,
    dist_attn_config: DistAttnConfig | None = None,
    *,
    pad_size: int | None = None,
    chunk_size: int | None = None,
) -> DistAttnRuntimeKey:
    """Plan distributed attention for a mask given as slices and return its key.

    Args:
        q_ranges, k_ranges: the slices' query and key ranges, half-open `[start, end)` in global token
            coordinates: lists of pairs, `magi_solver.AttnRanges` or int tensors `[num_slices, 2]`.
        attn_mask_type: per slice FULL / CAUSAL (bottom-right aligned) / INV_CAUSAL (top-left aligned) /
            BI_CAUSAL (both), as an `AttnMaskType`, a name, an int code 0-3, or a list of them.
        total_seqlen_q, total_seqlen_k: sequence lengths. Equal: self-attention (q, k and v are one sequence,
            dispatched with `dispatch`). Different: cross-attention (keys and values come from another
            sequence of `total_seqlen_k` tokens, dispatched with `dispatch_kv`: contiguous shards balanced by
            token count, equal unless `DispatchConfig(uneven_shard=True)`; the queries are balanced by mask
            area).
        num_heads_q, num_heads_kv, head_dim: attention shapes (num_heads_q % num_heads_kv == 0).
        cp_group_or_mesh: the context-parallel ProcessGroup, a 1-D DeviceMesh, or a 2-D (inter, intra) mesh.
        dist_attn_config: dispatch and overlap settings (`DistAttnConfig()` if None).
        pad_size: optional check (MagiAttention passes it): the padding the plan needs,
            `compute_pad_size(total_seqlen_q, cp_size, chunk_size)`; a different value raises ValueError.
            With `DispatchConfig(uneven_shard=True)` nothing is padded: only None or 0 is accepted.
        chunk_size: tokens per dispatch chunk, as `DispatchConfig(chunk_size=...)` (giving both with
            different values raises ValueError).

    The plan is built on first use and cached per group; it is identical on every rank.
    """
    q, k, types, total_q, total_k = _flex_mask(
        q_ranges, k_ranges, attn_mask_type, total_seqlen_q, total_seqlen_k
    )
    hq = _positive_int(num_heads_q, "num_heads_q")
    hkv = _positive_int(num_heads_kv, "num_heads_kv")
    if hq % hkv:
        raise ValueError(f"num_heads_q ({hq}) must be a multiple of num_heads_kv ({hkv})")
    d = _positive_int(head_dim, "head_dim")
    config = _key_config(dist_attn_config, chunk_size)
    _check_uneven_pad_size(config, pad_size)
    cp_group = _resolve_cp_group(cp_group_or_mesh)
    cp_group.local_rank()  # raises if this process is not in the group
    collective = (
        None if cp_group.size == 1 else choose_collective(config.grpcoll_config, cp_group.mesh is not None)
    )
    key = DistAttnRuntimeKey(q, k, types, total_q, total_k, hq, hkv, d, cp_group, config, collective)
    agree_on_key(key, key in RUNTIME_CACHE, pad_size)  # collective on a new key: see _fingerprint
    runtime = RUNTIME_CACHE.get(key)  # plan now, so bad masks raise here (the same on every rank)
    if pad_size is not None:
        layout = runtime.layout
        needed = layout.padded_seqlen - layout.total_seqlen
        # cp = 1 runs unpadded; a pad computed for it with compute_pad_size is accepted (and unused)
        chunk = config.dispatch_config.chunk_size or layout.chunk_size
        accepted = {needed, compute_pad_size(total_q, layout.cp_size, chunk)}
        if isinstance(pad_size, bool) or not isinstance(pad_size, int) or pad_size not in accepted:
            raise ValueError(
                f"pad_size={pad_size!r} does not match the plan: it pads {total_q} tokens by {needed} "
                f"(chunk {layout.chunk_size} x cp {layout.cp_size}); pass {needed} or leave it None"
            )
    return key


def _check_uneven_pad_size(config: DistAttnConfig, pad_size: Any) -> None:
    """Uneven shards pad nothing: a pad_size other than None / 0 means the caller pads tensors itself, which
    would not match the key's token count; refuse it before any collective."""
    if config.dispatch_config.uneven_shard and pad_size is not None:
        if isinstance(pad_size, bool) or not isinstance(pad_size, int) or pad_size != 0:
            raise ValueError(
                f"pad_size={pad_size!r} with DispatchConfig(uneven_shard=True): uneven shards pad nothing "
                "(ranks hold different token counts instead); pass pad_size=0 or leave it None, and do not "
                "pad the tensors"
            )


def _with_chunk_size(config: DistAttnConfig, chunk_size: int | None) -> DistAttnConfig:
    """The config with a key-level `chunk_size` folded into its DispatchConfig (one source of truth)."""
    if chunk_size is None:
        return config
    current = config.dispatch_config.chunk_size
    if current is not None and current != chunk_size:
        raise ValueError(
            f"chunk_size={chunk_size!r} differs from dist_attn_config.dispatch_config.chunk_size={current}: "
            "give it once"
        )
    dispatch_config = dataclasses.replace(config.dispatch_config, chunk_size=chunk_size)
    return dataclasses.replace(config, dispatch_config=dispatch_config)


@collective_key_build(_cp_group_arg)
def magi_attn_varlen_key(
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group_or_mesh: Any,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    dist_attn_config: DistAttnConfig | None = None,
    *,
    pad_size: int | None = None,
    chunk_size: int | None = None,
) -> DistAttnRuntimeKey:
    """Key for packed variable-length documents: document i attends within itself.

    Args:
        cu_seqlens_q, cu_seqlens_k: cumulative lengths `[num_docs + 1]` starting at 0 (list or int tensor).
            Equal: self-attention. Different (cross-attention): query document i attends key document i.
        num_heads_q, num_heads_kv, head_dim: attention shapes (num_heads_q % num_heads_kv == 0).
        cp_group_or_mesh: the context-parallel ProcessGroup, a 1-D DeviceMesh, or a 2-D (inter, intra) mesh.
        causal: causal attention inside each document (forces the window's right side to 0).
        window_size: `(left, right)` sliding window inside each document, -1 meaning unbounded.
        dist_attn_config: dispatch and overlap settings (`DistAttnConfig()` if None).
        pad_size, chunk_size: as in `magi_attn_flex_key`.
    """
    q_ranges, k_ranges, types, total_q, total_k = _varlen_mask(
        cu_seqlens_q, cu_seqlens_k, causal, window_size
    )
    return magi_attn_flex_key(
        q_ranges,
        k_ranges,
        types,
        total_q,
        total_k,
        num_heads_q,
        num_heads_kv,
        head_dim,
        cp_group_or_mesh,
        dist_attn_config,
        pad_size=pad_size,
        chunk_size=chunk_size,
    )


def prepare_flex_dispatch(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen_q: int,
    total_seqlen_k: int,
    cp_size: int,
    dist_attn_config: DistAttnConfig | None = None,
    *,
    chunk_size: int | None = None,
) -> PreparedDispatch:
    """Solve, ahead of time and without a process group, the dispatch a `magi_attn_flex_key` of this mask
    will need over `cp_size` ranks: the part of a new key's planning that grows with the mask (hundreds of
    milliseconds per new mask past a few ranks, docs/packages/magi_attention.md). Run it where that time is
    hidden, e.g. in a data-loader worker for the next batch, and pass the result to `adopt_dispatch` in the
    training process before that batch's key is built; the key then takes it instead of solving. A pure
    function of its arguments (no tensors, no communication); the result is picklable.

    Args:
        q_ranges, k_ranges, attn_mask_type, total_seqlen_q, total_seqlen_k: the mask and sizes, as
            `magi_attn_flex_key` takes them.
        cp_size: ranks of the cp group the key will be built on.
        dist_attn_config, chunk_size: as `magi_attn_flex_key` (only the dispatch settings matter here).

    Returns:
        A `PreparedDispatch` (`magi_solver`): the chosen chunk size and algorithm and the solved placement.

    Raises the key's own errors for a bad mask, size or config. Every rank may adopt it or not: a rank that
    does not solves the same placement itself.
    """
    q, k, types, total_q, total_k = _flex_mask(
        q_ranges, k_ranges, attn_mask_type, total_seqlen_q, total_seqlen_k
    )
    config = _key_config(dist_attn_config, chunk_size)
    cp = _positive_int(cp_size, "cp_size")
    return solve_dispatch_ahead((q, k, types), total_q, total_k, cp, config.dispatch_config)


def prepare_varlen_dispatch(
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    cp_size: int,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    dist_attn_config: DistAttnConfig | None = None,
    *,
    chunk_size: int | None = None,
) -> PreparedDispatch:
    """`prepare_flex_dispatch` for the packed-documents mask of `magi_attn_varlen_key`.

    Args:
        cu_seqlens_q, cu_seqlens_k, causal, window_size, dist_attn_config, chunk_size: as
            `magi_attn_varlen_key`.
        cp_size: ranks of the cp group the key will be built on.
    """
    q_ranges, k_ranges, types, total_q, total_k = _varlen_mask(
        cu_seqlens_q, cu_seqlens_k, causal, window_size
    )
    return prepare_flex_dispatch(
        q_ranges, k_ranges, types, total_q, total_k, cp_size, dist_attn_config, chunk_size=chunk_size
    )


@collective_key_build(_dispatch_key_group)
def make_varlen_key_for_new_mask_after_dispatch(
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    key_for_dispatch: DistAttnRuntimeKey,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> DistAttnRuntimeKey:
    """A packed-documents mask (as `magi_attn_varlen_key` builds it) over tensors already dispatched with
    `key_for_dispatch` (same token placement; e.g. the sliding-window layers of a hybrid model).

    Args:
        cu_seqlens_q, cu_seqlens_k: cumulative document lengths `[num_docs + 1]` (equal: self-attention).
        key_for_dispatch: the key the tensors were dispatched with.
        causal: causal attention inside each document.
        window_size: `(left, right)` sliding window inside each document, -1 meaning unbounded.
    """
    if not isinstance(key_for_dispatch, DistAttnRuntimeKey):
        raise TypeError(
            f"key_for_dispatch must be a DistAttnRuntimeKey, got {type(key_for_dispatch).__name__}"
        )
    cu_q = cu_seqlens_list(cu_seqlens_q, "cu_seqlens_q")
    cu_k = cu_seqlens_list(cu_seqlens_k, "cu_seqlens_k")
    if cu_q != cu_k:
        raise NotImplementedError("only self-attention is supported: cu_seqlens_q must equal cu_seqlens_k")
    if cu_q[-1] != key_for_dispatch.total_seqlen_q:
        raise ValueError(
            f"cu_seqlens_q ends at {cu_q[-1]} but key_for_dispatch covers {key_for_dispatch.total_seqlen_q} tokens"
        )
    mask = make_sliding_window_mask(cu_q, _window_pair(window_size, causal))
    return make_flex_key_for_new_mask_after_dispatch(
        mask.q_ranges, mask.k_ranges, mask.types, key_for_dispatch
    )


def _window_pair(window_size: Any, causal: bool) -> tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a (left, right) pair of ints, got {window_size!r}") from None
    for w in (left, right):
        if isinstance(w, bool) or not isinstance(w, int):
            raise ValueError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    # causal attention sees no key to the right of the query, whatever the window says
    return left, 0 if causal else right


@collective_key_build(_dispatch_key_group)
def make_flex_key_for_new_mask_after_dispatch(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    key_for_dispatch: DistAttnRuntimeKey,
) -> DistAttnRuntimeKey:
    """Key for a second mask over tensors already dispatched with `key_for_dispatch` (same token placement).

    Args:
        q_ranges, k_ranges, attn_mask_type: the new mask, in the forms `magi_attn_flex_key` accepts.
        key_for_dispatch: the key the tensors were dispatched with; shapes, group and config are taken from it.
    """
    if not isinstance(key_for_dispatch, DistAttnRuntimeKey):
        raise TypeError(
            f"key_for_dispatch must be a DistAttnRuntimeKey, got {type(key_for_dispatch).__name__}"
        )
    base = key_for_dispatch
    q = normalize_ranges(q_ranges, "q_ranges")
    k = normalize_ranges(k_ranges, "k_ranges")
    types = normalize_mask_types(attn_mask_type, len(q))
    _check_mask_bounds(q, k, base.total_seqlen_q, base.total_seqlen_k)
    q, k, types = _drop_empty_slices(q, k, types)
    key = DistAttnRuntimeKey(
        q,
        k,
        types,
        base.total_seqlen_q,
        base.total_seqlen_k,
        base.num_heads_q,
        base.num_heads_kv,
        base.head_dim,
        base.cp_group,
        base.config,
        base.collective,
        dispatch_key=base.root_key,
    )
    agree_on_key(key, key in RUNTIME_CACHE)
    RUNTIME_CACHE.get(key)
    return key


def get_position_ids(key: DistAttnRuntimeKey) -> torch.Tensor:
    """Global token index of each local token, int64 `[key.shard_seqlen]` (padding reuses the last valid
    id; with `DispatchConfig(uneven_shard=True)` there is no padding and the length differs per rank).

    Args:
        key: the runtime key the tensors are dispatched with.

    Returns a tensor on the device of the cp group's backend (CUDA for NCCL, CPU otherwise).
    """
    runtime = RUNTIME_CACHE.get(key)
    ids = torch.from_numpy(runtime.layout.local_token_ids(runtime.rank).copy())
    ids.clamp_(max=runtime.layout.total_seqlen - 1)
    return ids.to(_key_device(key))


def _key_device(key: DistAttnRuntimeKey) -> torch.device:
    group = key.cp_group.group
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_most_recent_key(cp_group_or_mesh: Any = None) -> DistAttnRuntimeKey | None:
    """The key most recently planned or used for `cp_group_or_mesh`, from the runtime cache (integrations use
    it to find the mask).

    Args:
        cp_group_or_mesh: the group or mesh the key was built for (None: the default group).
    """
    return RUNTIME_CACHE.most_recent_key(_resolve_cp_group(cp_group_or_mesh).name)


def get_kernel_backend(
    key: DistAttnRuntimeKey, dtype: torch.dtype = torch.bfloat16
) -> tuple[KernelBackend | str, str]:
    """The attention kernel `calc_attn` uses for this key with inputs of `dtype`, and why.

    The same on every rank: an explicit `kernel_backend` (or `MAGI_ATTENTION_KERNEL_BACKEND`) as asked, `auto`
    from the shipped table of measured kernel times (nearest measured mask and size, among the backends every
    rank can run) or, without a table for the GPU, the capability rule. A `softcap` that the chosen backend
    cannot take moves a `calc_attn` call to another backend (see `KernelBackend`). Plans the key if needed
    (a collective on first use, as `dispatch`).

    `auto` may run the backward on another backend than the forward where the table measured one clearly
    faster there; the reason then names both ("cudnn backward").

    Returns:
        ``(backend, reason)``: the forward's resolved `KernelBackend` (never AUTO; a registered backend's
        name where the config asked for one) and a one-line explanation.
    """
    choice = RUNTIME_CACHE.get(key).kernel_choice
    backend = choice.backend_for(dtype, key.head_dim)
    backward = choice.backward_for(dtype, key.head_dim)
    reason = choice.reason if backend == choice.backend else f"{choice.reason}; {dtype} inputs: {backend}"
    if backward != backend:
        reason = f"{reason}; backward: {backward}"
    return backend, reason


def get_dispatch_choice(key: DistAttnRuntimeKey) -> DispatchChoice:
    """How `key`'s tokens are dispatched: the chunk size and algorithm, the plan's overlap degree, its
    balance and the remote K/V of the busiest rank, with a one-sentence reason, and the slowest rank's
    predicted forward / backward kernel time (`predicted_fwd_ms` / `predicted_bwd_ms`, by the kernel law of
    `magi_solver.kernel_law`; for a key made after dispatch, its own mask on the inherited placement).

    With `DispatchConfig()` (the default) the placement (documents or chunk dispatch) and the chunk size are
    chosen per mask and cp size (`magi_solver.choice`); an explicit algorithm or size is used as given.
    A pure function of the global mask, the cp size and the config: the same on every rank. Plans the key if
    needed (a collective on first use, as `dispatch`); a key built by `magi_attn_*_key` is already planned.

    Returns:
        A frozen `DispatchChoice`. At cp 1: the whole sequence as one chunk on the one rank.
    """
    runtime = RUNTIME_CACHE.get(key)
    layout, plan = runtime.layout, runtime.plan
    if plan is None or layout.choice is None:
        return DispatchChoice(
            layout.chunk_size, "sequential", 0, 1.0, 1.0, 0, "cp 1: one rank holds the whole sequence."
        )
    own = plan.choice  # this key's own mask on its (possibly inherited) placement
    return DispatchChoice(
        layout.choice.chunk_size,
        layout.choice.algorithm,
        plan.overlap_degree,
        plan.imbalance,
        plan.dispatch.lower_bound_imbalance,
        max(plan.remote_tokens_per_rank),
        layout.choice.reason,
        None if own is None else own.predicted_fwd_ms,
        None if own is None else own.predicted_bwd_ms,
    )


def clear_cache(cp_group_or_mesh: Any = None) -> None:
    """Empty the runtime cache (the cached plans; docs/glossary.md). Collective: every rank of the group
    calls it at the same point of its calls.

    A rank that dropped its plans alone would re-plan alone: its next key build would agree with no one and
    its next `calc_attn` would check its GroupCast tables with no one, both waiting for the others until the
    process group's timeout. So `clear_cache` runs the status agreement first: the ranks that call it clear
    together, and a rank that meanwhile makes another call (`calc_attn`, `dispatch`, ...) raises on every
    rank, naming the calls ("ranks are in different calls"), with nothing cleared anywhere.

    Args:
        cp_group_or_mesh: drop only this group's plans (collective over it); None drops every group's plans
            (collective over the default process group: every rank of the job calls it).
    """
    if cp_group_or_mesh is None:
        name = None
        group = _resolve_cp_group(None)  # the default group, or one process without torch.distributed
    else:
        group = _resolve_cp_group(cp_group_or_mesh)
        name = group.name
    agree_on_call(group, "clear_cache", lambda: None, same=lambda: {"cp group": name})
    RUNTIME_CACHE.clear(name)


def warmup(
    key: DistAttnRuntimeKey,
    dtype: torch.dtype = torch.bfloat16,
    *,
    device: torch.device | str | None = None,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> None:
    """Compile every kernel this rank's part of `key` needs, before the first training step.

    Runs `calc_attn` forward and backward once on fresh random `q`, `k`, `v` of this rank's shapes
    (`[key.shard_seqlen, num_heads_q, head_dim]`, k/v `[key.kv_shard_seqlen, num_heads_kv, head_dim]`) in
    `dtype`: the same plan, backends (forward and backward, `auto`'s pick included) and deterministic
    variants (`DistAttnConfig.deterministic` or `MAGI_ATTENTION_DETERMINISTIC_MODE`) as the real calls, so
    their kernels are compiled (and, with the on-disk compile cache, stored for the next process). Where the
    key runs FA4, one local forward + backward per `magi_ffa_fa4.warmup_masks` mask also compiles the
    variants that later masks (new interval-width buckets, varlen window kinds) would need. No user
    tensor and no global random state is touched; the result is discarded.

    Collective: it runs exactly the communication of one `calc_attn` forward + backward, so every rank of the
    key's cp group must call it, with the same arguments. Kernels that depend on call arguments are only
    compiled for the ones given here: pass the `softmax_scale` / `softcap` of the real calls (attention
    sinks are not warmed up).

    Args:
        key: the runtime key of the real calls.
        dtype: the dtype of the real q, k, v (float16, bfloat16, float32 or float64).
        device: where the real tensors live. Default: the current CUDA device for an NCCL group or a
            single-process key on a CUDA machine, else the CPU.
        softmax_scale, softcap: as for `calc_attn`.

    Raises:
        TypeError: `key` is not a DistAttnRuntimeKey or `dtype` is not a supported torch dtype (raised
            before any communication, on every rank alike).
    """
    if not isinstance(key, DistAttnRuntimeKey):
        raise TypeError(f"key must be a DistAttnRuntimeKey, got {type(key).__name__}")
    if not isinstance(dtype, torch.dtype) or dtype not in CALC_ATTN_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in CALC_ATTN_DTYPES)
        raise TypeError(f"dtype must be one of {names}, got {dtype!r}")
    if device is None:
        group = key.cp_group.group
        if group is None:
            use_cuda = torch.cuda.is_available()
        else:
            use_cuda = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)  # our own: the user's random state is untouched

    def rand(rows: int, heads: int) -> torch.Tensor:
        x = torch.randn(rows, heads, key.head_dim, generator=gen, device=device, dtype=torch.float32)
        return x.to(dtype).requires_grad_(True)

    q = rand(key.shard_seqlen, key.num_heads_q)
    k = rand(key.kv_shard_seqlen, key.num_heads_kv)
    v = rand(key.kv_shard_seqlen, key.num_heads_kv)
    with torch.enable_grad():
        out, _ = calc_attn(q, k, v, key, softmax_scale, softcap)
        out.backward(torch.randn(out.shape, generator=gen, device=device, dtype=torch.float32).to(dtype))
    if device.type == "cuda":
        _warm_fa4_buckets(key, dtype, device, gen, softmax_scale, softcap)
        torch.cuda.synchronize(device)


def _warm_fa4_buckets(key, dtype, device, gen, softmax_scale, softcap) -> None:
    """Where this key runs FA4: compile its kernel variants for later masks too. FA4 keys a compiled kernel
    by the mask's interval-width bucket and varlen window kind (`magi_ffa_fa4.compile_key`), so one forward +
    backward per `magi_ffa_fa4.warmup_masks` mask (local, no communication) moves the compiles a new mask
    would bring out of the training loop. Deterministic mode skips the masks FA4 refuses there."""
    forward = get_kernel_backend(key, dtype)[0]
    backward = RUNTIME_CACHE.get(key).kernel_choice.backward_for(dtype, key.head_dim)
    total = key.shard_seqlen
    if KernelBackend.FA4 not in (forward, backward) or total < 512:
        return
    import magi_ffa_fa4

    deterministic = bool(getattr(key.config, "deterministic", False))
    shape_q = (total, key.num_heads_q, key.head_dim)
    shape_k = (total, key.num_heads_kv, key.head_dim)
    for q_ranges, k_ranges, types in magi_ffa_fa4.warmup_masks(total):
        if deterministic and not magi_ffa_fa4.deterministic_supported(
            q_ranges, k_ranges, types, total, total
        ):
            continue
        q, k, v = (
            torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            .to(dtype)
            .requires_grad_(True)
            for shape in (shape_q, shape_k, shape_k)
        )
        with torch.enable_grad():
            out = magi_ffa_fa4.flex_flash_attn_func(
                q, k, v, q_ranges, k_ranges, types, softmax_scale=softmax_scale, softcap=softcap,
                deterministic=deterministic,
            )[0]  # fmt: skip
            out.sum().backward()
