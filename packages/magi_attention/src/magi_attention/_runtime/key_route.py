"""A new key's route on one rank, step by step: the kernel choice, the plan, the deterministic restriction
and the kernel libraries' import, composed here in that order from frozen values (nothing below calls back),
and what the ranks tell each other about kernels inside the key's own agreement.

The kernel steps each ask one place: the agreed candidates and `auto`'s pick come from `kernels` (which asks
the solver once per key, `magi_solver.kernel_choice.advise_kernel`, about every rank's problem after dispatch,
`rank_problems`, and keeps the kernel law the plan's cost model prices with on the choice); the deterministic
restriction, and the pick again where it drops the pick, from `kernels.restrict_deterministic`; every
exchange with the other ranks goes through `exchange`.

`build_key` runs every step locally: it communicates nothing. Where the kernel choice of the key's kind was
not agreed before, it assumes every rank can run what this one can (the common case: the same software on
every rank) and says so in its `KeyWord`: a digest of what it can run (GPU kind, usable backends, why not the
requested one; 0 when the choice of the key's kind was agreed before) and whether the chosen kernel libraries
failed to import here. The word rides the key's agreement (`checks._key_agreement`); `settle` reads every
rank's word: equal digests keep the build; different ones (ranks with different software) exchange the full
lists (`gather_rank_backends`) and build again; a failed import makes every rank raise before any data moves
(`agree_imports`: the failing rank its ImportError, the others an AgreementError naming it). A key rebuilt
outside an agreement (evicted from the cache, then used) takes `build_alone`: its own exchanges, only where
nothing was agreed before. Choices are cached per (group, requested backend, head_dim, deterministic mode),
imports per backends.

Deterministic mode is decided once per key: the choice keeps the backends deterministic at the head_dim; once
the plan fixes every rank's kernel calls, each call is checked once and every candidate's verdict kept with
it (`kernels.restrict_deterministic`: an explicit backend that cannot raises on every rank before any data
moves; `auto` picks again without the others, there). The plan stays as built: a new pick changes only the
kernels.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from magi_ffa.validation import CheckedSlices, check_slices
from magi_group_collective.agreement import agree, host_group_of
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
from magi_solver.kernel_choice import RankProblems

from .._layout import DispatchLayout
from ..config import OverlapMode
from ..env import cost_profile_override, kernel_backend_override
from ..key import CpGroup, DistAttnRuntimeKey
from . import kernels
from .kernels import (
    AUTO,
    KernelChoice,
    RankBackends,
    choose_auto,
    ffa_backend,
    resolve,
    restrict_deterministic,
)


# -- what the ranks tell each other about kernels -------------------------------------------------------
class KeyWord(NamedTuple):
    """This rank's part of the key agreement about kernels (the `extra` integers of its row)."""

    digest: int
    """A 63-bit digest of this rank's `RankBackends` (never 0), or 0 when the choice was agreed before."""
    import_failed: int
    """1 when the chosen backends' kernel libraries failed to import on this rank."""


def requested_backend(configured: str) -> str:
    """The config's backend, with `auto` overridden by MAGI_ATTENTION_KERNEL_BACKEND."""
    override = kernel_backend_override()
    return str(override if configured == AUTO and override is not None else configured)


def choice_key(key: DistAttnRuntimeKey) -> tuple:
    """What a kernel choice is cached by: group, requested backend, head_dim, deterministic mode."""
    group, requested = key.cp_group, requested_backend(key.config.kernel_backend)
    return (group.name, group.ranks, requested, key.head_dim, bool(key.config.deterministic))


def digest(local: RankBackends) -> int:
    """A 63-bit digest of `local`, never 0 (the same value in every process)."""
    data = json.dumps([local.gpu_kind, list(local.usable), local.missing]).encode()
    return (int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1) or 1


_AGREED: dict[tuple, KernelChoice] = {}
"""Choices every rank of a group made alike (by `choice_key`)."""


def agreed_choice(key: DistAttnRuntimeKey) -> KernelChoice | None:
    """The key's kernel choice if one of its kind was agreed before (None: not yet)."""
    return _AGREED.get(choice_key(key))


def remember(key: DistAttnRuntimeKey, choice: KernelChoice) -> None:
    """Keep `choice` as agreed for keys of `key`'s kind."""
    _AGREED[choice_key(key)] = choice


def exchange(
    cp_group: CpGroup, call: str, *, error: BaseException | None = None, mine: bytes = b""
) -> list[bytes]:
    """The key route's one way to talk to the other ranks (collective on the host, only where the key's kind
    was not agreed before or the ranks differ): the status agreement of `call` first (it raises on every rank
    when `error` is set on one: that error there, an AgreementError naming it on the others, and tells ranks
    in another call so before any bytes cross), then every rank's `mine`, in rank order (none when empty)."""
    group = cp_group.group
    if group is None or cp_group.size == 1:
        if error is not None:
            raise error
        return [mine]
    agree(group, call, error=error)
    return host_group_of(group).gather_bytes(mine) if mine else []


def gather_rank_backends(cp_group: CpGroup, local: RankBackends) -> list[RankBackends]:
    """Every rank's backends (only when the digests differed, or a key is rebuilt without an agreement of its
    own): the sorted names travel as bytes, so ranks that registered other backends still meet."""
    mine = json.dumps([local.gpu_kind, list(local.usable), local.missing]).encode()
    parts = exchange(cp_group, "magi_attention key: the backends each rank can run", mine=mine)
    return [RankBackends(kind, tuple(usable), why) for kind, usable, why in map(json.loads, parts)]


_IMPORTED: set[tuple[str, ...]] = set()
"""Backends whose kernel libraries imported on every rank (recorded after the ranks agreed on it)."""


def _libraries(choice: KernelChoice) -> tuple[str, ...]:
    return tuple(sorted({str(choice.backend), str(choice.backward or choice.backend)}))


def imported(choice: KernelChoice) -> bool:
    """The choice's kernel libraries imported before, on every rank (nothing to import or agree)."""
    return _libraries(choice) in _IMPORTED


def note_imported(choice: KernelChoice) -> None:
    """Record that every rank imported the choice's kernel libraries (after the ranks agreed on it)."""
    _IMPORTED.add(_libraries(choice))


def import_libraries(choice: KernelChoice) -> ImportError | None:
    """Import the kernel libraries of the choice's forward and backward backends, and only those (the probes
    read what is installed without importing it); the error, naming the library, when one fails (None when
    all import). Local: the caller tells the other ranks (`KeyWord.import_failed`, `agree_imports`)."""
    for name in _libraries(choice):
        cap = ffa_backend(name).capability
        if cap.install_check is None:
            continue
        try:
            cap.install_check()
        except Exception as exc:  # a vendor may raise anything while it imports (OSError, RuntimeError)
            vendors = " and ".join(dist for dist, _ in cap.requires) or cap.package
            error = ImportError(
                f"kernel_backend={name!r}: {vendors} is installed but does not import on this rank "
                f"({type(exc).__name__}: {exc})"
            )
            error.__cause__ = exc
            return error
    return None


def agree_imports(cp_group: CpGroup, error: ImportError | None) -> None:
    """Raise on every rank when the kernel libraries failed to import on one (its ImportError there, an
    AgreementError naming it and the library on the others)."""
    exchange(cp_group, "magi_attention key: import the kernel libraries", error=error)


def probe_local(requested: str) -> RankBackends:
    """What this process can run (`kernels.probe_local`, looked up at call time so tests can replace it)."""
    return kernels.probe_local(requested)


def clear_agreements() -> None:
    """Forget every agreed choice and import (the next key of each kind exchanges again)."""
    _AGREED.clear()
    _IMPORTED.clear()


def every_rank(words: Sequence[Sequence[int]]) -> tuple[bool, bool]:
    """From every rank's `KeyWord` in the key agreement: (the digests are all equal, some import failed)."""
    digests = {tuple(w[:1]) for w in words}
    return len(digests) == 1, any(len(w) > 1 and w[1] for w in words)


# -- the key's steps -----------------------------------------------------------------------------------------
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


def build_key(key: DistAttnRuntimeKey, layout: DispatchLayout, *, gather: bool = False) -> KeyBuild:
    """The key's steps on this rank, in order: the kernel choice (agreed before for keys of its kind; else
    from every rank's backends: exchanged when `gather`, else assumed like this rank's, which communicates
    nothing), `auto`'s table, the plan, the deterministic restriction, and the import of the chosen kernel
    libraries."""
    det, head_dim = bool(key.config.deterministic), key.head_dim
    agreed, said, problems = agreed_choice(key), 0, rank_problems(key, layout)
    if agreed is None:
        requested = requested_backend(key.config.kernel_backend)
        local = probe_local(requested)
        if gather:
            ranks = gather_rank_backends(key.cp_group, local)
        else:  # assumed like this rank's; the digest in the key agreement checks it
            ranks, said = [local] * max(key.cp_size, 1), digest(local)
        try:
            agreed = resolve(requested, head_dim, ranks, det)
        except ValueError as exc:
            return KeyBuild(None, None, [], KeyWord(said, 0), choice_error=exc)

    choice = choose_auto(agreed, head_dim, problems, deterministic=det)
    plan = build_plan(key, layout, choice)
    mine: list[list[tuple[CallSlices, CheckedSlices]]] = []
    if det:
        calls = rank_kernel_calls(key, layout, plan)
        checked = [[check_slices(s.q_ranges, s.k_ranges, s.types, nq, nk) for s, nq, nk in c] for c in calls]
        mask = (key.q_ranges, key.k_ranges, key.attn_mask_type)
        try:  # decided once, there: the candidates kept and, where the pick was dropped, the pick again
            choice = restrict_deterministic(choice, checked, mask, head_dim, problems)
        except ValueError as exc:  # the same on every rank that shares the candidates
            return KeyBuild(None, None, [], KeyWord(said, 0), agreed, choice_error=exc)
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
        build = build_key(key, layout, gather=True)
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
    build = build_key(key, layout, gather=True)
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
    # the shipped profile's kernel part is the kernel law where one was fitted (magi_solver.kernel_law, kept
    # with the choice): the same law the dispatch choice priced with; a configured profile is used as it is
    law = choice.law if name is None else None
    return OverlapCostModel(
        profile=profile,
        num_heads_q=key.num_heads_q,
        num_heads_kv=key.num_heads_kv,
        head_dim=key.head_dim,
        law=law,
    )


def rank_problems(key: DistAttnRuntimeKey, layout: DispatchLayout) -> RankProblems:
    """Every rank's problem after dispatch as `auto`'s table is asked about it (`magi_solver.kernel_choice`):
    the key's mask, each rank's query rows (its slice of the layout's dispatched order) and the key/value
    shards of cross-attention. Values of the key and the layout alone, so the same on every rank."""
    rows = np.split(layout.permutation, np.cumsum(layout.shard_seqlens)[:-1])
    return RankProblems(key.q_ranges, key.k_ranges, key.attn_mask_type, rows, layout.kv_layout)


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
