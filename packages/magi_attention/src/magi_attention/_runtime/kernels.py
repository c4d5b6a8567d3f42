"""Which attention kernel the runtime calls: the same on every rank of a cp group, chosen before any plan.

Every kernel backend states once, in its capability (`magi_ffa.contract.BackendCapability`), what it takes,
where its backward is deterministic and its priority; this module asks the capabilities (`magi_ffa.choice`)
and names no backend itself. Each rank lists the backends it can run (`probe_local`: no vendor is imported to
find out); from every rank's list (`key_route` tells the ranks apart inside the key's agreement) `resolve`
keeps the same candidates on every rank: the backends every rank can run that take the head_dim. So ranks
with different software never plan or compute differently, and a requested backend that some rank cannot
run (or does not know) raises on every rank before any data moves. `auto` picks among the candidates by
the shipped table of measured kernel times (`choose_auto`: one question to the solver,
`magi_solver.kernel_choice.advise_kernel`, then the kernel law of the chosen backends); the table's rows
name the backends they measured, so nothing here names one. Each call's dtype and softcap refine
the choice among the same candidates (`KernelChoice.backend_for`).

Deterministic mode: a capability says at which head dims (`deterministic_head_dim`: applied at the agreement)
and on which slices (`deterministic`: applied once the plan fixes every rank's kernel calls, by
`restrict_deterministic`, alike on every rank, which also picks again when it drops the pick) its backward
is bitwise repeatable.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from magi_ffa.choice import choose, known_backends, load_backend, refusal, usable_backends
from magi_ffa.validation import CheckedSlices
from magi_solver.kernel_choice import MaskFeatures, RankProblems, advise_kernel
from magi_solver.kernel_law import KernelLaw, find_kernel_law

from ..config import KernelBackend
from .launch import AttnKernel, attn_kernel, backend_name, ffa_backend

__all__ = [
    "AttnKernel",
    "KernelChoice",
    "RankBackends",
    "attn_kernel",
    "backend_name",
    "choose_auto",
    "ffa_backend",
    "resolve",
    "restrict_deterministic",
]

AUTO = "auto"
KEY_DTYPE = torch.bfloat16  # a key's choice is for 16-bit inputs; each call's dtype refines it


@dataclass(frozen=True, slots=True)
class RankBackends:
    """What one rank of a group can run, as the ranks exchange it."""

    gpu_kind: str
    """The rank's GPU kind ("h200", ..., "cpu")."""
    usable: tuple[str, ...]
    """The sorted names of the backends it can run (`magi_ffa.choice.usable_backends`)."""
    missing: str = ""
    """Why it cannot run the requested backend ("" when it can, or for `auto`)."""


def local_gpu_kind() -> str:
    """This process's GPU kind ("cpu" without CUDA): the kind of rank 0 selects `auto`'s table and profiles."""
    if not torch.cuda.is_available():
        return "cpu"
    from magi_solver import gpu_kind

    return gpu_kind(torch.cuda.get_device_name())


def backend_missing(name: str) -> str:
    """Why this process cannot run backend `name` ("" when it can): no backend of that name, a library not
    installed, or this GPU (read from what is installed: no vendor is imported)."""
    backend = load_backend(str(name))
    if backend is None:  # others are added with magi_ffa.contract.register_backend
        return f"no kernel backend named {str(name)!r} here (known: {', '.join(known_backends())})"
    return backend.capability.missing()


def probe_local(requested: str = AUTO) -> RankBackends:
    """What this process can run, and why not the requested backend."""
    missing = "" if requested == AUTO else backend_missing(requested)
    return RankBackends(local_gpu_kind(), tuple(usable_backends(known_backends())), missing)


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The backend every rank of a group uses (for 16-bit inputs), what it was chosen among and why."""

    backend: KernelBackend | str
    """The forward's backend for 16-bit inputs (never `auto`): its `KernelBackend` member, or its name (a
    `KernelBackend` is a `str`: both compare equal to the name; `backend_for` returns the member)."""
    requested: KernelBackend | str
    """The config's choice after the MAGI_ATTENTION_KERNEL_BACKEND override of `auto`."""
    gpu_kind: str
    """Rank 0's GPU kind ("h200", ..., "cpu"): selects `auto`'s table and the overlap cost profile."""
    candidates: tuple[str, ...]
    """The backends every rank can run that take the key's head_dim (deterministically, in deterministic
    mode), sorted: what `auto` and the per-call refinement choose among."""
    reason: str = ""
    """Why this backend: the explicit request, the capabilities' priority, or `auto`'s table row."""
    backward: KernelBackend | str | None = None
    """`auto` only: the backward's backend where the table measured another one clearly faster there than
    `backend` (None: `backend`). The backward starts from the final out / lse, whichever backend made them."""
    on_gpu: bool = True
    """Every rank has a CUDA GPU (else `auto` leaves the GPU backends to explicit requests)."""
    law: KernelLaw | None = None
    """The shipped kernel law of (`gpu_kind`, `backend`, `backward`) where one was fitted, set by `choose_auto`
    (None before, and where none was fitted): the dynamic overlap's cost model prices the key's plan with the
    law of the choice the plan is built for."""

    def backend_for(self, dtype: torch.dtype, head_dim: int, softcap: float = 0.0) -> KernelBackend | str:
        """The forward's backend for inputs of `dtype` with this `softcap`: the same on every rank.
        ValueError (naming why and the backends that can) if an explicit choice cannot take them."""
        return self._refined(self.backend, dtype, head_dim, softcap)

    def backward_for(self, dtype: torch.dtype, head_dim: int, softcap: float = 0.0) -> KernelBackend | str:
        """The backward's backend: `backward` where it takes these inputs, else the forward's."""
        forward = self.backend_for(dtype, head_dim, softcap)
        if self.backward is None or forward != self.backend:  # refined away from the table's pick
            return forward
        return self._refined(self.backward, dtype, head_dim, softcap)

    def _refined(
        self, backend: str, dtype: torch.dtype, head_dim: int, softcap: float
    ) -> KernelBackend | str:
        if not refusal(ffa_backend(backend).capability, dtype, head_dim, softcap):
            return backend_name(backend)
        # an explicit request raises here (naming why and the alternatives); auto takes the next by priority
        name = choose(self.candidates, requested=str(self.requested), dtype=dtype, head_dim=head_dim,
                      softcap=softcap, on_gpu=self.on_gpu)  # fmt: skip
        return backend_name(name)


def by_priority(choice: KernelChoice, head_dim: int, why: str = "") -> KernelChoice:
    """`auto`'s capability rule: the candidate of the highest priority that takes 16-bit inputs at this
    head_dim (the torch reference takes everything)."""
    name = choose(choice.candidates, dtype=KEY_DTYPE, head_dim=head_dim, on_gpu=choice.on_gpu)
    rule = "priority" if choice.on_gpu else "priority without a GPU on every rank"
    reason = f"auto: {name}, by the capabilities' {rule} among {list(choice.candidates)}{why}"
    return dataclasses.replace(choice, backend=backend_name(name), backward=None, reason=reason, law=None)


def resolve(
    requested: str, head_dim: int, ranks: Sequence[RankBackends], deterministic: bool = False
) -> KernelChoice:
    """The choice from every rank's `RankBackends` (a pure function of values every rank shares, so every
    rank decides alike). Raises ValueError when an explicit `requested` cannot run on every rank, does not
    take `head_dim`, or (`deterministic`) has no deterministic backward at `head_dim`."""
    requested = str(requested)
    common = set.intersection(*(set(r.usable) for r in ranks))
    if requested != AUTO:
        bad = [
            f"rank {i}: {r.missing or 'cannot run it'}"
            for i, r in enumerate(ranks)
            if requested not in r.usable
        ]
        if bad:
            raise ValueError(
                f"kernel_backend={requested!r} cannot run on every rank of the cp group: " + "; ".join(bad)
            )
        cap = ffa_backend(requested).capability
        if not cap.head_dim_ok(head_dim):
            raise ValueError(
                f"kernel_backend={requested!r} needs head_dim {cap.head_dim_rule}, got {head_dim}"
            )

    def takes(name: str) -> bool:
        cap = ffa_backend(name).capability
        return cap.head_dim_ok(head_dim) and (not deterministic or cap.deterministic_head_dim(head_dim))

    candidates = tuple(sorted(n for n in common if takes(n)))
    if requested != AUTO and requested not in candidates:  # deterministic mode, at this head_dim
        can = " or ".join(repr(n) for n in (AUTO, *candidates))
        raise ValueError(
            f"kernel_backend={requested!r} has no deterministic backward at head_dim {head_dim} "
            f"(DistAttnConfig.deterministic is True; its capability's deterministic_head_dim refuses it); use "
            f"kernel_backend={can}"
        )
    on_gpu = all(r.gpu_kind != "cpu" for r in ranks)
    choice = KernelChoice(backend_name(requested), backend_name(requested), ranks[0].gpu_kind, candidates,
                          f"kernel_backend={requested!r} (explicit)", on_gpu=on_gpu)  # fmt: skip
    return choice if requested != AUTO else by_priority(choice, head_dim)


Features = RankProblems | Callable[[], MaskFeatures]
"""What `auto`'s table is asked about: every rank's problem after dispatch (the runtime), or a function that
returns the busiest rank's features (the same on every rank)."""


def choose_auto(
    choice: KernelChoice, head_dim: int, problems: Features, *, deterministic: bool = False
) -> KernelChoice:
    """The choice with `auto` refined by the shipped table of rank 0's GPU kind (the candidate with the
    smallest measured forward + backward time on the nearest measured row, possibly a forward on one backend
    and a backward on another; the deterministic rows in `deterministic` mode) and the kernel law of the
    backends that run. One question to the solver (`advise_kernel`); the features are computed only when the
    table measured two candidates. Explicit choices, and groups without a GPU on every rank, keep their
    backends; without a table for the GPU kind (or a row for the head_dim) the capabilities' priority stays,
    and the reason says so. A pure function of values every rank shares."""
    asked = choice.candidates if choice.requested == AUTO and choice.on_gpu else ()
    advice = advise_kernel(choice.gpu_kind, head_dim, asked, problems, deterministic=deterministic)
    if advice.pick is None:
        forward, backward = choice.backend, choice.backward
        reason = f"{advice.reason} ({choice.reason})" if advice.reason else choice.reason
    else:
        # the table's names as they are (`backend_for` gives the `KernelBackend` member where one is)
        forward, backward = advice.pick.forward, advice.pick.backward
        backward, reason = backward if backward != forward else None, f"auto: {advice.pick.reason}"
    law = find_kernel_law(choice.gpu_kind, str(forward), None if backward is None else str(backward))
    return dataclasses.replace(choice, backend=forward, backward=backward, reason=reason, law=law)


Mask = tuple[Sequence[Sequence[int]], Sequence[Sequence[int]], Sequence[int]]
"""A mask's slices: (q_ranges, k_ranges, types)."""


def describe_mask(
    q_ranges: Sequence[Sequence[int]], k_ranges: Sequence[Sequence[int]], types: Sequence[int]
) -> str:
    """A short name of a mask's kind for messages: one slice, packed documents (ascending disjoint query and
    key ranges in the same order, one type, full or causal: `magi_solver.kernel_choice.MaskFeatures`), or its
    slice count and types."""
    names = {0: "full", 1: "causal", 2: "inv_causal", 3: "bi_causal"}
    kinds = sorted({names.get(int(t), str(t)) for t in types})
    if len(types) == 1:
        return f"one {kinds[0]} slice"
    ascending = all(a[1] <= b[0] for r in (q_ranges, k_ranges) for a, b in itertools.pairwise(r))
    if ascending and len(kinds) == 1 and kinds[0] in ("full", "causal"):
        return f"{len(types)} packed {kinds[0]} documents"
    return f"{len(q_ranges)} slices of types {', '.join(kinds)}"


def restrict_deterministic(
    choice: KernelChoice,
    rank_calls: Sequence[Sequence[CheckedSlices]],
    mask: Mask,
    head_dim: int,
    problems: Features | None = None,
) -> KernelChoice:
    """The choice in deterministic mode, decided here once per key, given every rank's kernel calls of the
    plan (checked slices) of the key's `mask`: the candidates whose backward is deterministic on every call
    of every rank (`deterministic_on`, evaluated once per call and kept with its slices). Unchanged when all
    are; else an explicit backend that is not raises ValueError naming it, the ranks, the mask's kind and the
    backends that can, and `auto` drops the others: where its pick was among them it picks again, by the
    capabilities' priority and then (given `problems`) by the table's deterministic rows (`choose_auto`). A
    pure function of values every rank shares: every rank decides alike."""
    bad = {}
    for name in choice.candidates:
        cap = load_backend(name).capability
        ranks = [r for r, calls in enumerate(rank_calls) if not all(map(cap.deterministic_on, calls))]
        if ranks:
            bad[name] = ranks
    if not bad:
        return choice
    kept = tuple(n for n in choice.candidates if n not in bad)
    if choice.requested != AUTO:
        if choice.requested not in bad:
            return dataclasses.replace(choice, candidates=kept)
        cap = load_backend(choice.requested).capability
        raise ValueError(
            f"kernel_backend={str(choice.requested)!r} cannot run a deterministic backward on rank(s) "
            f"{bad[choice.requested]} of the cp group (DistAttnConfig.deterministic is True): their kernel "
            f"calls on this mask ({describe_mask(*mask)}) are refused there: {cap.nondeterministic_masks}; use "
            f"kernel_backend={' or '.join(repr(n) for n in (AUTO, *kept))}"
        )
    narrowed = dataclasses.replace(choice, candidates=kept)
    if {choice.backend, choice.backward or choice.backend} <= set(kept):
        return narrowed
    dropped = ", ".join(sorted(bad))
    again = by_priority(
        narrowed, head_dim, f" (deterministic mode: {dropped} not deterministic on every rank)"
    )
    return again if problems is None else choose_auto(again, head_dim, problems, deterministic=True)
