"""A new key's route on one rank, step by step: the kernel choice, the plan, the deterministic restriction
and the kernel libraries' import, composed here in that order from frozen values (nothing below calls back).

`build_key` runs every step locally: it communicates nothing. Where the kernel choice of the key's kind was
not agreed before, it assumes every rank can run what this one can, and says so in its `KeyWord` (a digest of
this rank's backends, and whether the chosen libraries failed to import), which rides the key's own agreement
(`checks._key_agreement`). `settle` reads every rank's word after that agreement: equal digests keep the
build; different ones exchange the full lists and build again; a failed import raises on every rank. A key
rebuilt outside an agreement (evicted from the cache, then used) takes `build_alone`: its own exchanges,
only where nothing was agreed before.

Deterministic mode is decided once per key: the choice keeps the backends deterministic at the head_dim; once
the plan fixes every rank's kernel calls, each call is checked once and every candidate's verdict kept with
it (`kernels.restrict_deterministic`: an explicit backend that cannot raises on every rank before any data
moves; `auto` picks again without the others). The plan stays as built: a new pick changes only the kernels.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from magi_ffa.validation import CheckedSlices, check_slices
from magi_solver import (
    PROFILES,
    DistAttnPlan,
    OverlapCostModel,
    PlanOptions,
    SliceList,
    get_profile,
    load_profile,
    plan_attention,
)
from magi_solver.kernel_choice import MaskFeatures, busiest_rank_features, kernel_key_ids
from magi_solver.kernel_law import find_kernel_law

from .._layout import DispatchLayout
from ..config import OverlapMode
from ..env import cost_profile_override
from ..key import DistAttnRuntimeKey
from .auto_kernel import choose_auto
from .kernels import KernelChoice, RankBackends, resolve, restrict_deterministic
from .rank_backends import (
    KeyWord,
    agree_imports,
    agreed_choice,
    digest,
    every_rank,
    gather_rank_backends,
    import_libraries,
    imported,
    note_imported,
    probe_local,
    remember,
    requested_backend,
)

CallSlices = tuple[SliceList, int, int]
"""One kernel call: its slices, query rows and key rows."""


@dataclass(frozen=True, slots=True)
class KeyBuild:
    """What one rank built for a key: its kernel choice, plan and checked calls, and its word to the others."""

    choice: KernelChoice | None
    """The key's kernel choice (None when `choice_error`)."""
    plan: DistAttnPlan | None
    """The comm plan and stages (None at cp 1, or when `choice_error`)."""
    checked: list[list[tuple[CallSlices, CheckedSlices]]]
    """Deterministic mode: per rank, its kernel calls checked with their determinism verdicts (else empty)."""
    word: KeyWord
    """What this rank tells the others in the key's agreement."""
    agreed: KernelChoice | None = None
    """The choice of the key's kind before `auto`'s table and the plan refined it (kept for later keys)."""
    choice_error: ValueError | None = None
    """Why the requested backend cannot run (raised on every rank once the ranks' backends are known)."""
    import_error: ImportError | None = None
    """The kernel library that failed to import on this rank."""
    import_tried: bool = False
    """The choice's kernel libraries were imported by this build (not before, on every rank)."""


def build_key(
    key: DistAttnRuntimeKey, layout: DispatchLayout, ranks: Sequence[RankBackends] | None = None
) -> KeyBuild:
    """The key's steps on this rank, in order, communicating nothing: the kernel choice (agreed before for
    keys of its kind; else from `ranks`, every rank's backends, or, None, assumed like this rank's), `auto`'s
    table, the plan, the deterministic restriction, and the import of the chosen kernel libraries."""
    det, head_dim = bool(key.config.deterministic), key.head_dim
    agreed, said = agreed_choice(key), 0
    if agreed is None:
        requested = requested_backend(key.config.kernel_backend)
        if ranks is None:  # assumed like this rank's; the digest in the key agreement checks it
            local = probe_local(requested)
            ranks, said = [local] * max(key.cp_size, 1), digest(local)
        try:
            agreed = resolve(requested, head_dim, ranks, det)
        except ValueError as exc:
            return KeyBuild(None, None, [], KeyWord(said, 0), choice_error=exc)

    def features() -> MaskFeatures:
        return rank_problem_features(key, layout)

    choice = choose_auto(agreed, head_dim, features, deterministic=det)
    plan = build_plan(key, layout, choice)
    mine: list[list[tuple[CallSlices, CheckedSlices]]] = []
    if det:
        calls = rank_kernel_calls(key, layout, plan)
        checked = [[check_slices(s.q_ranges, s.k_ranges, s.types, nq, nk) for s, nq, nk in c] for c in calls]
        mask = (key.q_ranges, key.k_ranges, key.attn_mask_type)
        try:
            restricted = restrict_deterministic(choice, checked, mask, head_dim)
        except ValueError as exc:  # the same on every rank that shares the candidates
            return KeyBuild(None, None, [], KeyWord(said, 0), agreed, choice_error=exc)
        if restricted.backend != choice.backend or restricted.backward != choice.backward:
            restricted = choose_auto(restricted, head_dim, features, deterministic=det)
        choice = restricted
        mine = [list(zip(c, k, strict=True)) for c, k in zip(calls, checked, strict=True)]
    tried = not imported(choice)
    error = import_libraries(choice) if tried else None  # only the libraries the choice runs
    return KeyBuild(choice, plan, mine, KeyWord(said, int(error is not None)), agreed, None, error, tried)


def settle(
    key: DistAttnRuntimeKey, layout: DispatchLayout, build: KeyBuild, words: Sequence[Sequence[int]]
) -> KeyBuild:
    """The build every rank keeps, from every rank's `KeyWord` in the key's agreement (`words`, rank order):
    the same digests keep `build`; different ones exchange the backends and build again (every rank, since
    every rank saw the words). Raises on every rank when the requested backend cannot run or a kernel
    library failed to import (one more exchange, only then)."""
    same, import_failed = every_rank(words)
    if not same:  # ranks with different software: what they can run, told in full
        local = probe_local(requested_backend(key.config.kernel_backend))
        build = build_key(key, layout, gather_rank_backends(key.cp_group, local))
        import_failed = build.import_tried  # the rebuilt choice's import is agreed in its own exchange
    if build.choice_error is not None:  # every rank decided alike from the same backends
        raise build.choice_error
    if import_failed:
        agree_imports(key.cp_group, build.import_error)
    remember(key, build.agreed)
    note_imported(build.choice)
    return build


def build_alone(key: DistAttnRuntimeKey, layout: DispatchLayout) -> KeyBuild:
    """`build_key` for a key planned outside a key agreement (rebuilt after its eviction): the backends and
    the import agreed in exchanges of their own, where the key's kind was not agreed before."""
    ranks = None
    if agreed_choice(key) is None:
        local = probe_local(requested_backend(key.config.kernel_backend))
        ranks = gather_rank_backends(key.cp_group, local)
    build = build_key(key, layout, ranks)
    return settle(key, layout, build, [[1, int(build.import_tried)]])


def overlap_cost_model(key: DistAttnRuntimeKey, choice: KernelChoice) -> OverlapCostModel:
    """The dynamic overlap's cost model: the configured profile, else MAGI_ATTENTION_COST_PROFILE, else the
    shipped profile of (rank 0's GPU kind, backend). Sized for 16-bit inputs (the dtype is not in the key)."""
    name = key.config.overlap_config.cost_profile or cost_profile_override()
    if name is None:
        profile = get_profile(choice.gpu_kind, str(choice.backend))
    elif name in PROFILES:
        profile = PROFILES[name]
    elif name.endswith(".json") or os.path.sep in name:
        profile = load_profile(name)
    else:
        raise ValueError(
            f"cost profile {name!r} is neither a JSON file nor one of {sorted(PROFILES)} "
            "(OverlapConfig.cost_profile / MAGI_ATTENTION_COST_PROFILE)"
        )
    # the shipped profile's kernel part is the kernel law where one was fitted (magi_solver.kernel_law): the
    # same law the dispatch choice priced with; a configured profile is used as it is
    law = None
    if name is None:
        bwd = None if choice.backward is None else choice.backward.value
        law = find_kernel_law(choice.gpu_kind, choice.backend.value, bwd)
    return OverlapCostModel(
        profile=profile,
        num_heads_q=key.num_heads_q,
        num_heads_kv=key.num_heads_kv,
        head_dim=key.head_dim,
        law=law,
    )


def rank_problem_features(key: DistAttnRuntimeKey, layout: DispatchLayout) -> MaskFeatures:
    """The busiest rank's problem after dispatch as its kernel sees it (its query rows against its own keys
    first, then the keys other ranks send), as `auto`'s table describes masks; a function of the key and the
    layout alone, so the same on every rank."""
    rows = [layout.local_token_ids(r) for r in range(layout.cp_size)]
    keys = kernel_key_ids(rows, layout.kv_layout)
    return busiest_rank_features(
        [list(r) for r in key.q_ranges],
        [list(r) for r in key.k_ranges],
        list(key.attn_mask_type),
        rows,
        rank_keys=keys,
    )


def rank_kernel_calls(
    key: DistAttnRuntimeKey, layout: DispatchLayout, plan: DistAttnPlan | None
) -> list[list[CallSlices]]:
    """Per rank of the group, the kernel calls the plan makes there: (slices, query rows, key rows) each, as
    `DistAttnRuntime._build_device_meta` builds them (the merged call at overlap degree 0, else the host call
    and one per remote stage; the whole mask at cp 1). The same on every rank."""
    if plan is None:
        whole = SliceList(key.q_ranges, key.k_ranges, key.attn_mask_type)
        return [[(whole, key.total_seqlen_q, key.total_seqlen_k)]]
    calls = []
    for r, rank_plan in enumerate(plan.ranks):
        rows, local_kv = layout.shard_seqlens[r], layout.kv_shard_seqlens[r]
        remote = [s.num_remote_tokens for s in rank_plan.stages]
        if plan.overlap_degree == 0:
            calls.append([(rank_plan.merged_slices, rows, local_kv + sum(remote))])
            continue
        mine = [(rank_plan.host_slices, rows, local_kv)]
        calls.append(
            mine + [(s.remote_slices, rows, n) for s, n in zip(rank_plan.stages, remote, strict=True)]
        )
    return calls


def plan_options(key: DistAttnRuntimeKey, choice: KernelChoice) -> PlanOptions:
    """The key's dispatch and overlap configs as the solver's planning options (enums as they are)."""
    dispatch, ov = key.config.dispatch_config, key.config.overlap_config
    dynamic = ov.mode == OverlapMode.DYNAMIC
    return PlanOptions(
        dispatch_alg=dispatch.alg,
        overlap_degree=None if dynamic else ov.degree,
        overlap_mode=ov.mode,
        min_chunk_size=ov.min_chunk_size,
        max_num_chunks=ov.max_num_chunks,
        dynamic_max_degree=ov.max_degree,
        cost_model=overlap_cost_model(key, choice) if dynamic else None,
        uneven_shard=dispatch.uneven_shard,
    )


def build_plan(key: DistAttnRuntimeKey, layout: DispatchLayout, choice: KernelChoice) -> DistAttnPlan | None:
    """Comm plan and stages of the key's mask on the (possibly borrowed) dispatch layout."""
    if key.cp_size == 1:
        return None
    # the layout's dispatch, solved once per root key: a root key's own mask reuses it as it is, a mask made
    # after dispatch keeps its tokens where they are (only the areas are recomputed)
    return plan_attention(
        key.q_ranges,
        key.k_ranges,
        key.attn_mask_type,
        layout.padded_seqlen,
        key.cp_size,
        chunk_size=layout.chunk_size,
        options=plan_options(key, choice),
        kv_layout=layout.kv_layout,
        dispatch=layout.dispatch_plan,
    )
