"""The one door to the planner: `plan_attention` (dispatch, then per rank the host slices, the remote K/V
it must fetch stage by stage with the GroupCast/GroupReduce arguments, and the slices of every stage) and
its dispatch step alone, `dispatch_choice`. The planner's types (`PlanOptions`, what a plan holds) are in
`_plan_types`; how a plan is assembled from a solved dispatch, in `_assemble`. `plan_dist_attn` and
`plan_with_options` are deprecated wrappers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from ._assemble import Dispatched, build_plan
from ._plan_types import DistAttnPlan, PlanOptions, RankPlan, StagePlan, _check_uneven, _parse_alg
from .choice import (
    DispatchChoice,
    chosen_times,
    default_chunk_size,
    mask_digest,
    predicted_choice_times,
    prepare_choice,
    remember_choice,
)
from .cost_model import OverlapCostModel
from .dispatch import DispatchAlg, DispatchPlan, padded_seqlen, redispatch_areas, validate_geometry
from .kernel_law import law_for_mask
from .kv_layout import KVLayout
from .mask import normalize_mask
from .pricing import price_plan
from .ranges import _check_int, _check_positive

__all__ = [
    "DistAttnPlan",
    "PlanOptions",
    "PreparedDispatch",
    "RankPlan",
    "StagePlan",
    "adopt_dispatch",
    "dispatch_choice",
    "plan_attention",
    "plan_dist_attn",
    "plan_with_options",
    "prepare_dispatch",
]

#: the release that removes `plan_dist_attn` and `plan_with_options` (docs/migration.md)
REMOVED_IN = "0.2.0"

_SAME_SEQUENCE_ALGS = (DispatchAlg.AFFINITY, DispatchAlg.DOCUMENTS)
"""Algorithms that pair query and key chunks of one sequence (refused for cross-attention)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Request:
    """One planning request as given (checked by the step that reads it): the mask, its geometry and the
    dispatch asked for."""

    q_ranges: Any
    k_ranges: Any
    attn_mask_type: Any
    total_seqlen: Any
    """Query tokens before padding."""
    cp_size: Any
    chunk_size: Any = None
    """None: chosen per mask and cp size."""
    dispatch_alg: DispatchAlg | None = None
    """Parsed already (`_parse_alg`)."""
    uneven_shard: bool = False
    total_seqlen_k: Any = None
    """Cross-attention: tokens of the key sequence (`k_ranges` index it); None: self-attention."""


def plan_attention(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    *,
    chunk_size: int | None = None,
    options: PlanOptions | None = None,
    kv_layout: KVLayout | None = None,
    total_seqlen_k: int | None = None,
    dispatch: DispatchPlan | None = None,
) -> DistAttnPlan:
    """Plan attention with context parallelism over `cp_size` ranks: the one planning path of the runtime,
    `magi-attention-plan`, `magi_solver.tools` and the benchmarks (a pure function, the same on every rank).

    Args:
        q_ranges, k_ranges, attn_mask_type: the mask (see `solve_dispatch`) over `total_seqlen` queries.
        total_seqlen: query tokens before padding; padded to a multiple of `chunk_size * cp_size` (the plan's
            `dispatch.total_seqlen`), unless `options.uneven_shard`.
        cp_size: ranks.
        chunk_size: tokens per dispatch chunk; None chooses it (and, with `options.dispatch_alg` None, the
            algorithm) per mask and cp size from the balance lower bound, the tile-fill cost of fragments and
            the remote K/V of the busiest rank (`magi_solver.choice`). An explicit size is always used.
        options: overlap and dispatch options (default `PlanOptions(dispatch_alg=None)`: chosen).
        kv_layout: cross-attention: where keys and values live (`KVLayout`, `cp_size` ranks).
        total_seqlen_k: cross-attention without a `kv_layout`: the key sequence's length (before padding);
            it is split into contiguous shards of `default_chunk_size(total_seqlen_k, cp_size)` chunks.
        dispatch: reuse this chunk assignment (a mask built after dispatch keeps its tokens where they are);
            its geometry must be this plan's.

    Returns:
        A `DistAttnPlan` whose `choice` says which chunk size and algorithm, and why.
    """
    if options is None:
        options = PlanOptions(dispatch_alg=None)
    elif not isinstance(options, PlanOptions):
        raise TypeError(f"`options` must be a PlanOptions, got {type(options).__name__}")
    cp_size = _check_int(cp_size, "cp_size")
    kv_layout = _key_layout(kv_layout, total_seqlen_k, cp_size, options.uneven_shard)
    request = _Request(
        q_ranges=q_ranges,
        k_ranges=k_ranges,
        attn_mask_type=attn_mask_type,
        total_seqlen=total_seqlen,
        cp_size=cp_size,
        chunk_size=chunk_size,
        dispatch_alg=options.dispatch_alg,
        uneven_shard=options.uneven_shard,
        total_seqlen_k=None if kv_layout is None else kv_layout.total_seqlen,
    )
    step = _dispatch_step(request) if dispatch is None else _given_dispatch(request, dispatch)
    return build_plan(Dispatched(*step, kv_layout=kv_layout), options)


def _key_layout(kv_layout: Any, total_seqlen_k: Any, cp_size: int, uneven: bool) -> KVLayout | None:
    """Cross-attention's key layout: the one given, or contiguous default shards of `total_seqlen_k`."""
    if kv_layout is None and total_seqlen_k is not None:
        tk = _check_int(total_seqlen_k, "total_seqlen_k")
        if tk <= 0 or cp_size <= 0:
            raise ValueError(f"`total_seqlen_k` and `cp_size` must be positive, got {tk}, {cp_size}")
        kc = default_chunk_size(tk, cp_size)
        kv_layout = KVLayout(tk if uneven else padded_seqlen(tk, cp_size, kc), cp_size, kc, uneven)
    if kv_layout is None:
        return None
    if not isinstance(kv_layout, KVLayout):
        raise TypeError(f"`kv_layout` must be a KVLayout or None, got {type(kv_layout).__name__}")
    if (kv_layout.cp_size, kv_layout.uneven_shard) != (cp_size, uneven):
        raise ValueError(
            f"`kv_layout` has (cp_size, uneven_shard) = {(kv_layout.cp_size, kv_layout.uneven_shard)}, "
            f"the plan {(cp_size, uneven)}"
        )
    return kv_layout


@dataclass(frozen=True, slots=True)
class PreparedDispatch:
    """A solved dispatch choice that one process hands to another (e.g. a data-loader worker to the
    training loop: `prepare_dispatch`, then `adopt_dispatch` where the plan is built), so the solve is not
    repeated there. Picklable; compared by value.

    Attributes:
        request: what it was solved for: `(mask digest, total_seqlen, cp_size, chunk_size, algorithm asked,
            uneven_shard, cross_attention)` (the planner cache's key).
        choice: the `DispatchChoice` the solve made.
        plan: the solved `DispatchPlan`.
    """

    request: tuple
    choice: DispatchChoice
    plan: DispatchPlan


def dispatch_choice(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    *,
    chunk_size: int | None = None,
    dispatch_alg: DispatchAlg | str | None = None,
    uneven_shard: bool = False,
    total_seqlen_k: int | None = None,
) -> tuple[DispatchChoice, DispatchPlan]:
    """The dispatch step of `plan_attention` on its own (the runtime's layout calls it before the kernel
    backend, which prices the overlap, is known): the chosen (or given) chunk size and algorithm and the
    solved `DispatchPlan`, cached per mask, geometry and request, so `plan_attention` reuses it.

    Args:
        q_ranges, k_ranges, attn_mask_type: the mask, as in `solve_dispatch`, over `total_seqlen` queries.
        total_seqlen: query tokens *before* padding; the plan pads to a multiple of `chunk_size * cp_size`
            (the dispatch's `total_seqlen` is the padded length), unless `uneven_shard`.
        cp_size: ranks.
        chunk_size: tokens per chunk; None chooses it per mask and cp size (`magi_solver.choice`).
        dispatch_alg: a `DispatchAlg`; None: chosen with the chunk size (min_heap with an explicit one).
        uneven_shard: no padding; ranks' token counts may differ by one chunk.
        total_seqlen_k: cross-attention: the key sequence's length (`k_ranges` index it); None: self.

    Returns:
        `(choice, dispatch)`; `choice.overlap_degree` is -1 until a plan is built.
    """
    prepared = prepare_dispatch(
        q_ranges,
        k_ranges,
        attn_mask_type,
        total_seqlen,
        cp_size,
        chunk_size=chunk_size,
        dispatch_alg=dispatch_alg,
        uneven_shard=uneven_shard,
        total_seqlen_k=total_seqlen_k,
    )
    return prepared.choice, prepared.plan


def prepare_dispatch(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    *,
    chunk_size: int | None = None,
    dispatch_alg: DispatchAlg | str | None = None,
    uneven_shard: bool = False,
    total_seqlen_k: int | None = None,
) -> PreparedDispatch:
    """`dispatch_choice` as a value to hand to another process: solve a mask's dispatch where its time is
    hidden (a data-loader worker preparing the next batch) and `adopt_dispatch` it where the plan is built,
    so that process finds it cached instead of solving. Arguments as `dispatch_choice` (the same checks and
    errors); the result is picklable and also cached here."""
    request = _Request(
        q_ranges=q_ranges,
        k_ranges=k_ranges,
        attn_mask_type=attn_mask_type,
        total_seqlen=total_seqlen,
        cp_size=cp_size,
        chunk_size=chunk_size,
        dispatch_alg=_parse_alg(dispatch_alg),
        uneven_shard=_check_uneven(uneven_shard),
        total_seqlen_k=total_seqlen_k,
    )
    return _prepared_step(request)[1]


def adopt_dispatch(
    prepared: PreparedDispatch, *, cp_size: int | None = None, total_seqlen: int | None = None
) -> None:
    """Put a dispatch solved elsewhere (`magi_solver.prepare_dispatch`, in this or another process) into this
    process's planner cache: the next `dispatch_choice` / `plan_attention` of the same request (mask, sizes,
    cp size, chunk size, algorithm, uneven shards) takes it instead of solving. The solve is a pure function
    of the request, so an adopted dispatch equals the one this process would solve with the same code.

    Args:
        prepared: the solved dispatch.
        cp_size, total_seqlen: where given, the cp size and (unpadded) token count the caller will plan with:
            a dispatch solved for others would never be taken, so it is refused instead (a loader that
            planned for the wrong group or batch fails at once rather than solving again unseen).

    Raises:
        TypeError: `prepared` is not a `PreparedDispatch`.
        ValueError: its plan does not fit its request (cp size, or a padded length / chunk size it cannot
            have been solved for), or it was solved for another `cp_size` / `total_seqlen` than given.
    """
    if not isinstance(prepared, PreparedDispatch):
        raise TypeError(f"`prepared` must be a PreparedDispatch, got {type(prepared).__name__}")
    request, choice, plan = prepared.request, prepared.choice, prepared.plan
    if not (isinstance(request, tuple) and len(request) == 7 and isinstance(plan, DispatchPlan)):
        raise ValueError("`prepared` holds no solved request (build it with magi_solver.prepare_dispatch)")
    _, total, cp, chunk, _, uneven, _ = request
    if (
        plan.cp_size != cp
        or bool(plan.uneven_shard) != bool(uneven)
        or plan.total_seqlen < total
        or (chunk is not None and plan.chunk_size != chunk)
        or choice.chunk_size != plan.chunk_size
    ):
        raise ValueError(
            f"`prepared`'s plan (cp {plan.cp_size}, {plan.total_seqlen} tokens, chunk {plan.chunk_size}) does "
            f"not answer its request (cp {cp}, {total} tokens, chunk {chunk})"
        )
    if cp_size is not None and cp_size != cp:
        raise ValueError(f"`prepared` was solved for cp size {cp}, but the cp group has {cp_size} ranks")
    if total_seqlen is not None and total_seqlen != total:
        raise ValueError(
            f"`prepared` was solved for {total} tokens, but this batch has {total_seqlen}: another batch's"
        )
    remember_choice(request, (choice, plan))


def _prepared_step(request: _Request) -> tuple[list[tuple[int, int, int, int, int]], PreparedDispatch]:
    """Check the request, normalise its mask and choose (or take) the chunk size and algorithm: the
    normalised slices and the solved request."""
    total_seqlen = _check_positive(request.total_seqlen, "total_seqlen")
    cp_size = _check_positive(request.cp_size, "cp_size")
    chunk_size, alg, uneven = request.chunk_size, request.dispatch_alg, request.uneven_shard
    if chunk_size is not None and _check_int(chunk_size, "chunk_size") <= 0:
        raise ValueError(f"`chunk_size` must be positive or None, got {chunk_size}")
    cross = request.total_seqlen_k is not None
    if cross and alg in _SAME_SEQUENCE_ALGS:
        raise ValueError(
            f"dispatch_alg={alg.value!r} pairs query and key chunks of one sequence: not for cross-attention"
        )
    total_k = _check_int(request.total_seqlen_k, "total_seqlen_k") if cross else total_seqlen
    slices = normalize_mask(request.q_ranges, request.k_ranges, request.attn_mask_type, total_seqlen, total_k)
    if chunk_size is not None:  # a named error for a geometry that cannot hold cp chunks
        padded = total_seqlen if uneven else padded_seqlen(total_seqlen, cp_size, chunk_size)
        validate_geometry(padded, cp_size, chunk_size, uneven_shard=uneven)
    solved, choice, dispatch = prepare_choice(
        slices,
        total_seqlen,
        cp_size,
        chunk_size=chunk_size,
        alg=alg,
        uneven_shard=uneven,
        cross_attention=cross,
    )
    return slices, PreparedDispatch(solved, choice, dispatch)


_Step = tuple[DispatchPlan, list[tuple[int, int, int, int, int]], DispatchChoice]
"""`(dispatch, slices, choice)`: a dispatch step's result (the `Dispatched` of a plan, less its key layout)."""


def _dispatch_step(request: _Request) -> _Step:
    """Check the request, normalise its mask and choose (or take) the chunk size and algorithm."""
    slices, prepared = _prepared_step(request)
    return prepared.plan, slices, prepared.choice


def _given_dispatch(request: _Request, dispatch: Any) -> _Step:
    """A given chunk assignment, checked against the request's geometry, with this mask's areas (and a
    choice that says it was given)."""
    if not isinstance(dispatch, DispatchPlan):
        raise TypeError(f"`dispatch` must be a DispatchPlan or None, got {type(dispatch).__name__}")
    uneven, cp_size, total_k = request.uneven_shard, request.cp_size, request.total_seqlen_k
    total_seqlen = _check_int(request.total_seqlen, "total_seqlen")
    chunk_size = request.chunk_size
    cs = dispatch.chunk_size if chunk_size is None else _check_int(chunk_size, "chunk_size")
    padded = total_seqlen if uneven or cs <= 0 or cp_size <= 0 else padded_seqlen(total_seqlen, cp_size, cs)
    padded, cp_size, cs = validate_geometry(padded, cp_size, cs, uneven_shard=uneven)
    got = (dispatch.total_seqlen, dispatch.cp_size, dispatch.chunk_size, dispatch.uneven_shard)
    if got != (padded, cp_size, cs, uneven):
        raise ValueError(
            f"`dispatch` was made for (total_seqlen, cp_size, chunk_size, uneven_shard) = {got}, "
            f"not {(padded, cp_size, cs, uneven)}"
        )
    slices = normalize_mask(
        request.q_ranges, request.k_ranges, request.attn_mask_type, padded, total_k or padded
    )
    cross = total_k is not None
    times = chosen_times(dispatch, mask_digest(slices), padded, cross)
    if times is None:
        again = redispatch_areas(dispatch, slices)
        # the same mask's dispatch (the runtime's root key) is used as it is: solved once
        dispatch = dispatch if again.chunk_areas == dispatch.chunk_areas else again
        # this mask's own predicted times on the given placement (a derived key's, not its root's)
        times = predicted_choice_times(
            price_plan(dispatch, slices, law_for_mask(slices, padded), cross=cross)
        )
    # else: the dispatch the choice solved for this very mask (the runtime's root key): its chunk areas are this
    # mask's and its predicted times were priced alike, so neither is measured again
    choice = DispatchChoice(
        dispatch.chunk_size,
        dispatch.alg.value,
        -1,
        dispatch.imbalance,
        dispatch.lower_bound_imbalance,
        0,
        f"the dispatch of chunk {dispatch.chunk_size} ({dispatch.alg.value}) was given.",
        *times,
    )
    return dispatch, slices, choice


# ------------------------------------------------------------------------------------- deprecated doors


def _deprecated(name: str, how: str) -> None:
    warnings.warn(
        f"`magi_solver.{name}` is deprecated and will be removed in {REMOVED_IN}: use "
        f"`magi_solver.plan_attention` ({how})",
        DeprecationWarning,
        stacklevel=3,
    )


def plan_dist_attn(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    chunk_size: int,
    *,
    dispatch_alg: str = "min_heap",
    overlap_degree: int | None = 1,
    overlap_mode: str = "static",
    min_chunk_size: int = 512,
    max_num_chunks: int = 64,
    dynamic_max_degree: int = 8,
    calc_cost_factor: float = 1.0,
    comm_cost_factor: float = 1.0,
    dispatch: DispatchPlan | None = None,
    cost_model: OverlapCostModel | None = None,
    total_seqlen_k: int | None = None,
    kv_chunk_size: int | None = None,
    uneven_shard: bool = False,
) -> DistAttnPlan:
    """Deprecated (removed in 0.2.0): `plan_attention` with an explicit, already padded geometry.

    `plan_attention(q_ranges, k_ranges, attn_mask_type, total_seqlen, cp_size, chunk_size=chunk_size,
    options=PlanOptions(...), kv_layout=KVLayout(total_seqlen_k, cp_size, kv_chunk_size or chunk_size,
    uneven_shard), dispatch=dispatch)` plans the same; the keywords `dispatch_alg`, `overlap_degree`,
    `overlap_mode`, `min_chunk_size`, `max_num_chunks`, `dynamic_max_degree`, `calc_cost_factor`,
    `comm_cost_factor`, `cost_model` and `uneven_shard` are `PlanOptions`' fields of the same names.
    `q_ranges`, `k_ranges`, `attn_mask_type`, `cp_size` and `dispatch` are `plan_attention`'s;
    `total_seqlen` must already be a multiple of `chunk_size * cp_size` (unless `uneven_shard`), and
    `total_seqlen_k` (cross-attention) of `kv_chunk_size * cp_size`.
    """
    _deprecated("plan_dist_attn", "chunk_size=..., options=PlanOptions(...), kv_layout=KVLayout(...)")
    options = PlanOptions(
        dispatch_alg=dispatch_alg,
        overlap_degree=overlap_degree,
        overlap_mode=overlap_mode,
        min_chunk_size=min_chunk_size,
        max_num_chunks=max_num_chunks,
        dynamic_max_degree=dynamic_max_degree,
        calc_cost_factor=calc_cost_factor,
        comm_cost_factor=comm_cost_factor,
        cost_model=cost_model,
        uneven_shard=uneven_shard,
    )
    # this wrapper's contract: the geometry is already padded (plan_attention would pad it)
    total_seqlen, cp_size, chunk_size = validate_geometry(
        total_seqlen, cp_size, chunk_size, uneven_shard=uneven_shard
    )
    kv_layout = None
    if total_seqlen_k is not None:
        kv_chunk = chunk_size if kv_chunk_size is None else kv_chunk_size
        kv_layout = KVLayout(total_seqlen_k, cp_size, kv_chunk, uneven_shard)
    elif kv_chunk_size is not None:
        raise ValueError("`kv_chunk_size` is for cross-attention: give `total_seqlen_k` too")
    return plan_attention(
        q_ranges, k_ranges, attn_mask_type, total_seqlen, cp_size,
        chunk_size=chunk_size, options=options, kv_layout=kv_layout, dispatch=dispatch,
    )  # fmt: skip


def plan_with_options(
    q_ranges: Any,
    k_ranges: Any,
    attn_mask_type: Any,
    total_seqlen: int,
    cp_size: int,
    chunk_size: int,
    options: PlanOptions,
    *,
    kv_layout: KVLayout | None = None,
    dispatch: DispatchPlan | None = None,
) -> DistAttnPlan:
    """Deprecated (removed in 0.2.0): `plan_attention(q_ranges, k_ranges, attn_mask_type, total_seqlen,
    cp_size, chunk_size=chunk_size, options=options, kv_layout=kv_layout, dispatch=dispatch)`."""
    _deprecated("plan_with_options", "chunk_size and options by keyword")
    return plan_attention(
        q_ranges, k_ranges, attn_mask_type, total_seqlen, cp_size,
        chunk_size=chunk_size, options=options, kv_layout=kv_layout, dispatch=dispatch,
    )  # fmt: skip
