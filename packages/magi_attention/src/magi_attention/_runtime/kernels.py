"""Which attention kernel the runtime calls, agreed by every rank of a cp group before any plan is made.

Each rank probes what it can run (flash-attn-4 / cuDNN's flex_attention importable, GPU architecture, CUDA
at all); the ranks
exchange those flags once per (group, requested backend, head_dim) with one tiny all-gather, and every rank
resolves the same backend from the same gathered flags. So ranks with different software never plan or
compute differently, and an explicit choice that some rank cannot run raises on every rank, before any
collective of the attention itself. The dtype and softcap are only known at `calc_attn`:
`KernelChoice.backend_for` refines the choice for them (a deterministic function of values every rank shares).

Deterministic mode (`DistAttnConfig.deterministic`): every backward must be bitwise repeatable. Triton and
torch always are, cuDNN is with its deterministic flag, and FA4 only on its varlen path (packed documents):
its block-sparse backward has no deterministic variant. Which path FA4 takes depends on each kernel call's
slices, which the plan fixes for every rank, so every rank evaluates every rank's calls
(`fa4_deterministic_supported`) and `restrict_deterministic` drops FA4 from `auto` (or raises for an
explicit `fa4`) identically everywhere, with no communication and before any data moves.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

import magi_ffa
from magi_ffa.contract import FFABackend, get_backend
from magi_ffa.validation import CheckedSlices, check_slices
from magi_group_collective.agreement import agree
from magi_solver.kernel_choice import MaskFeatures, load_kernel_table, pick_kernel

from ..config import KernelBackend
from ..env import kernel_backend_override, triton_interpret
from ..key import CpGroup

GPU_KINDS = ("cpu", "h100", "h200", "b200", "other")
"""GPU kinds as exchanged between ranks (index = code); the cost profile is chosen by rank 0's kind."""

_FA4_DTYPES = (torch.float16, torch.bfloat16)
_CUDNN_DTYPES = (torch.float16, torch.bfloat16)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class LocalCapability:
    """What this process can run; `*_missing` says why not (empty when it can)."""

    fa4_missing: str
    triton_missing: str
    gpu_kind: str
    cudnn_missing: str = "magi-ffa-cudnn was not probed"


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The backend every rank of a group uses (for fp16/bf16 inputs) and what it was resolved from."""

    backend: KernelBackend
    """Resolved backend for fp16/bf16 inputs (never AUTO)."""
    requested: KernelBackend
    """The config's choice after the MAGI_ATTENTION_KERNEL_BACKEND override of `auto`."""
    gpu_kind: str
    """Rank 0's GPU kind ("h200", ..., "cpu"): selects the shipped overlap cost profile."""
    triton_everywhere: bool

    fa4_everywhere: bool = False
    """Every rank can run FA4 at this head_dim (the fallback of a cuDNN choice that cannot take a call)."""
    cudnn_everywhere: bool = False
    """Every rank can run cuDNN's flex_attention at this head_dim (a candidate of `auto`)."""
    reason: str = ""
    """Why this backend: the explicit request, the capability rule, or `auto`'s table row."""
    backward: KernelBackend | None = None
    """`auto` only: the backend of the backward when the table measured another one clearly faster there
    than `backend` (None: the backward runs on `backend` too). The backward starts from the final out / lse,
    whichever backend made them."""

    def backward_for(self, dtype: torch.dtype, head_dim: int, softcap: float = 0.0) -> KernelBackend:
        """The backward's backend for these inputs: `backward` where it can take them, else the forward's
        (`backend_for`)."""
        forward = self.backend_for(dtype, head_dim, softcap)
        if self.backward is None or forward != self.backend:  # refined away from the table's pick
            return forward
        other = dataclasses.replace(self, backend=self.backward, backward=None)
        return other.backend_for(dtype, head_dim, softcap)

    def backend_for(self, dtype: torch.dtype, head_dim: int, softcap: float = 0.0) -> KernelBackend:
        """The (forward's) backend for inputs of `dtype` with this `softcap`: the same on every rank,
        ValueError if an explicit choice cannot take them."""
        if self.backend == KernelBackend.CUDNN and (dtype not in _CUDNN_DTYPES or softcap != 0):
            if self.requested == KernelBackend.CUDNN:
                if softcap != 0:
                    raise ValueError(
                        f"`softcap` must be 0 with kernel_backend='cudnn' (cuDNN flex_attention has no "
                        f"soft-capping), got {softcap!r}; use kernel_backend='fa4', 'triton' or 'auto'"
                    )
                raise ValueError(
                    f"kernel_backend='cudnn' needs float16/bfloat16 inputs, got {dtype}; "
                    "use kernel_backend='auto', 'triton' (fp32) or 'torch' (fp64)"
                )
            if dtype in _FA4_DTYPES and self.fa4_everywhere:
                return KernelBackend.FA4
            return self._fallback(dtype, head_dim)
        if self.backend == KernelBackend.FA4 and dtype not in _FA4_DTYPES:
            if self.requested == KernelBackend.FA4:
                raise ValueError(
                    f"kernel_backend='fa4' needs float16/bfloat16 inputs, got {dtype}; "
                    "use kernel_backend='auto', 'triton' (fp32) or 'torch' (fp64)"
                )
            return self._fallback(dtype, head_dim)
        if self.backend == KernelBackend.TRITON and dtype not in _TRITON_DTYPES:
            if self.requested == KernelBackend.TRITON:
                raise ValueError(
                    f"kernel_backend='triton' supports float16/bfloat16/float32, got {dtype}; use 'torch' or 'auto'"
                )
            return KernelBackend.TORCH
        return self.backend

    def _fallback(self, dtype: torch.dtype, head_dim: int) -> KernelBackend:
        ok = self.triton_everywhere and dtype in _TRITON_DTYPES and magi_ffa.triton_head_dim_ok(head_dim)
        return KernelBackend.TRITON if ok else KernelBackend.TORCH


def probe_local() -> LocalCapability:
    """What this process can run, and why not."""
    if torch.cuda.is_available():
        from magi_solver import gpu_kind

        kind = gpu_kind(torch.cuda.get_device_name())
        triton_missing = ""
    else:
        kind = "cpu"
        triton_missing = "" if triton_interpret() else "no CUDA GPU (and TRITON_INTERPRET is not set)"
    return LocalCapability(
        _fa4_missing(), triton_missing, kind if kind in GPU_KINDS else "other", _cudnn_missing()
    )


def _fa4_missing() -> str:
    return _package_missing("magi_ffa_fa4", "fa4")


def _cudnn_missing() -> str:
    return _package_missing("magi_ffa_cudnn", "cudnn")


def _package_missing(package: str, row: str) -> str:
    """Why this process cannot run the backend of `package` ("" when it can), read from what is installed and
    this GPU's architecture: the vendor's kernels are not imported (`BackendCapability.missing`)."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        name = package.replace("_", "-")
        return (
            f'{name} is not installed (install row "{row}": python scripts/install.py {row}, docs/install.md)'
        )
    return module.CAPABILITY.missing()


_AGREED: dict[tuple, KernelChoice] = {}


def agree_kernel_choice(cp_group: CpGroup, configured: KernelBackend, head_dim: int) -> KernelChoice:
    """Resolve the backend on every rank of `cp_group` from every rank's capabilities (one all-gather per
    group, requested backend and head_dim; cached). Raises ValueError on every rank when an explicit choice
    cannot run somewhere."""
    override = kernel_backend_override()
    requested = override if configured == KernelBackend.AUTO and override is not None else configured
    cache_key = (cp_group.name, cp_group.ranks, requested, head_dim)
    choice = _AGREED.get(cache_key)
    if choice is None:
        choice = _resolve(requested, head_dim, _gather(cp_group, probe_local()))
        _AGREED[cache_key] = choice
    return choice


def _gather(cp_group: CpGroup, local: LocalCapability) -> list[LocalCapability]:
    """Every rank's capability flags (reasons are kept only for this rank: others report a generic one)."""
    group = cp_group.group
    if group is None or cp_group.size == 1:
        return [local]
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor(
        [
            int(not local.fa4_missing),
            int(not local.triton_missing),
            GPU_KINDS.index(local.gpu_kind),
            int(not local.cudnn_missing),
        ],
        dtype=torch.int64,
        device=device,
    )
    parts = [torch.empty_like(mine) for _ in range(cp_group.size)]
    dist.all_gather(parts, mine, group=group)
    me = dist.get_rank(group)
    out = []
    for r, p in enumerate(parts):
        if r == me:
            out.append(local)
            continue
        fa4_ok, triton_ok, kind, cudnn_ok = (int(x) for x in p.tolist())
        out.append(
            LocalCapability(
                "" if fa4_ok else "FA4 cannot run there",
                "" if triton_ok else "no CUDA GPU there",
                GPU_KINDS[kind],
                "" if cudnn_ok else "cuDNN flex_attention cannot run there",
            )
        )
    return out


def _resolve(requested: KernelBackend, head_dim: int, ranks: list[LocalCapability]) -> KernelChoice:
    fa4_everywhere = all(not r.fa4_missing for r in ranks)
    cudnn_everywhere = all(not r.cudnn_missing for r in ranks)
    triton_everywhere = all(not r.triton_missing for r in ranks)
    kind = ranks[0].gpu_kind
    fa4_dim_ok = _fa4_head_dim_ok(head_dim)
    triton_dim_ok = magi_ffa.triton_head_dim_ok(head_dim)
    if requested == KernelBackend.FA4:
        _require(fa4_everywhere, "fa4", ranks, lambda r: r.fa4_missing)
        if not fa4_dim_ok:
            raise ValueError(
                f"kernel_backend='fa4' needs head_dim <= 128 and a multiple of 8, got {head_dim}"
            )
        backend = KernelBackend.FA4
    elif requested == KernelBackend.CUDNN:
        _require(cudnn_everywhere, "cudnn", ranks, lambda r: r.cudnn_missing)
        if not _cudnn_head_dim_ok(head_dim):
            raise ValueError(
                f"kernel_backend='cudnn' needs head_dim a multiple of 8 up to 128, or 256, got {head_dim}"
            )
        backend = KernelBackend.CUDNN
    elif requested == KernelBackend.TRITON:
        _require(triton_everywhere, "triton", ranks, lambda r: r.triton_missing)
        if not triton_dim_ok:
            raise ValueError(
                f"kernel_backend='triton' needs a power-of-two head_dim in [16, 256], got {head_dim}"
            )
        backend = KernelBackend.TRITON
    elif requested == KernelBackend.TORCH:
        backend = KernelBackend.TORCH
    elif fa4_everywhere and fa4_dim_ok:
        backend = KernelBackend.FA4
    elif triton_everywhere and triton_dim_ok and kind != "cpu":
        backend = KernelBackend.TRITON
    else:
        backend = KernelBackend.TORCH
    if requested != KernelBackend.AUTO:
        reason = f"kernel_backend={requested.value!r} (explicit)"
    elif backend == KernelBackend.FA4:
        reason = "auto: FA4 runs on every rank (no measured table applied yet)"
    else:
        reason = f"auto: {backend.value} by the capability rule (FA4, then Triton on a GPU, then torch)"
    return KernelChoice(
        backend, requested, kind, triton_everywhere, fa4_everywhere and fa4_dim_ok,
        cudnn_everywhere and _cudnn_head_dim_ok(head_dim), reason,
    )  # fmt: skip


def fa4_deterministic_supported(
    q_ranges: Sequence[Sequence[int]],
    k_ranges: Sequence[Sequence[int]],
    types: Sequence[int],
    total_q: int,
    total_k: int,
) -> bool:
    """Whether FA4 runs the backward of one kernel call on these slices deterministically: its varlen path
    (packed documents), not its block-sparse one (`magi_ffa_fa4.deterministic_supported`). An empty call runs
    no kernel (True). False when magi-ffa-fa4 is not installed. Pure host work on the slice values."""
    if len(types) == 0:
        return True
    try:
        import magi_ffa_fa4
    except ImportError:
        return False
    q = torch.tensor([list(r) for r in q_ranges], dtype=torch.int32).reshape(-1, 2)
    k = torch.tensor([list(r) for r in k_ranges], dtype=torch.int32).reshape(-1, 2)
    t = torch.tensor(list(types), dtype=torch.int32).reshape(-1)
    return bool(magi_ffa_fa4.deterministic_supported(q, k, t, int(total_q), int(total_k)))


def describe_mask(q_ranges: Sequence[Sequence[int]], types: Sequence[int], documents: bool) -> str:
    """A short name of a mask's kind for messages: full / causal, packed documents, or its slice count and
    types (`documents`: the slices are packed documents, as `magi_solver.kernel_choice.MaskFeatures`)."""
    names = {0: "full", 1: "causal", 2: "inv_causal", 3: "bi_causal"}
    kinds = sorted({names.get(int(t), str(t)) for t in types})
    if len(types) == 1:
        return f"one {kinds[0]} slice"
    if documents:
        return f"{len(types)} packed {kinds[0]} documents"
    return f"{len(q_ranges)} slices of types {', '.join(kinds)}"


def restrict_deterministic_head_dim(choice: KernelChoice, head_dim: int) -> KernelChoice:
    """The choice in deterministic mode at this head_dim, before any plan: cuDNN leaves `auto`'s candidates
    where its capability has no deterministic backward at this head_dim (`deterministic_head_dim`), and an
    explicit `cudnn` there raises ValueError (on every rank: a function of the config and head_dim alone)."""
    if not (choice.cudnn_everywhere or choice.requested == KernelBackend.CUDNN):
        return choice
    cap = ffa_backend(KernelBackend.CUDNN).capability
    if cap.deterministic_head_dim(head_dim):
        return choice
    if choice.requested == KernelBackend.CUDNN:
        can = [b for b in deterministic_alternatives(choice, head_dim) if b != "cudnn"]
        raise ValueError(
            f"kernel_backend='cudnn' has no deterministic backward at head_dim {head_dim} (DistAttnConfig."
            "deterministic is True; cuDNN's deterministic backward does not compile at this head_dim: "
            f"magi_ffa_cudnn.DETERMINISTIC_MAX_HEAD_DIM); use kernel_backend={' or '.join(repr(b) for b in can)}"
        )
    return dataclasses.replace(choice, cudnn_everywhere=False)


def restrict_deterministic(
    choice: KernelChoice, fa4_ok_per_rank: Sequence[bool], mask_kind: str, head_dim: int
) -> KernelChoice:
    """The choice in deterministic mode, given per rank whether FA4 can run all of that rank's kernel calls'
    backward deterministically (`fa4_deterministic_supported` on each call of the plan). All True: unchanged.
    Otherwise FA4 leaves the candidates of `auto` and the fallbacks (`fa4_everywhere` False; re-run
    `choose_auto` afterwards), and an explicit `fa4` raises ValueError naming the backend, the ranks, the mask
    kind and the backends that can. A pure function of values every rank shares: every rank decides alike."""
    bad = [r for r, ok in enumerate(fa4_ok_per_rank) if not ok]
    if not bad:
        return choice
    if choice.requested == KernelBackend.FA4:
        can = deterministic_alternatives(choice, head_dim)
        raise ValueError(
            f"kernel_backend='fa4' cannot run a deterministic backward on rank(s) {bad} of the cp group "
            f"(DistAttnConfig.deterministic is True): their kernel calls on this mask ({mask_kind}) take "
            "FA4's block-sparse path, whose backward has no deterministic variant (only packed documents run "
            f"FA4's deterministic varlen path); use kernel_backend={' or '.join(repr(b) for b in can)}"
        )
    return dataclasses.replace(choice, fa4_everywhere=False)


def deterministic_alternatives(choice: KernelChoice, head_dim: int) -> list[str]:
    """The backends other than FA4 that run deterministically on every rank of `choice` ('auto' first)."""
    can = ["auto"]
    if choice.cudnn_everywhere:
        can.append("cudnn")
    if choice.triton_everywhere and magi_ffa.triton_head_dim_ok(head_dim):
        can.append("triton")
    return [*can, "torch"]


def uses_fa4(choice: KernelChoice) -> bool:
    """FA4 may run a backward of this choice: as its backend, its backward, or the fallback of cuDNN."""
    fallback = choice.backend == KernelBackend.CUDNN and choice.fa4_everywhere
    return KernelBackend.FA4 in (choice.backend, choice.backward) or fallback


def choose_auto(
    choice: KernelChoice,
    head_dim: int,
    features: Callable[[], MaskFeatures],
    *,
    deterministic: bool = False,
) -> KernelChoice:
    """`auto` refined by the shipped table of rank 0's GPU kind: the candidate every rank can run with the
    smallest measured forward + backward time on the nearest measured row (`magi_solver.kernel_choice`).
    `features` is called only when a table and two candidates exist; it must return the same value on every
    rank (it is computed from the global mask and the dispatch). Without a table the capability rule stays and
    the reason says so. `deterministic`: the table's deterministic rows (`pick_kernel(deterministic=True)`);
    the candidates are those `choice` allows (after `restrict_deterministic`)."""
    if choice.requested != KernelBackend.AUTO or choice.backend == KernelBackend.TORCH:
        return choice
    if choice.backend == KernelBackend.FA4 and not choice.fa4_everywhere:
        # FA4 was ruled out (deterministic mode): the capability rule without it
        ok = choice.triton_everywhere and magi_ffa.triton_head_dim_ok(head_dim) and choice.gpu_kind != "cpu"
        if choice.cudnn_everywhere:
            fallback = KernelBackend.CUDNN
        else:
            fallback = KernelBackend.TRITON if ok else KernelBackend.TORCH
        choice = dataclasses.replace(
            choice, backend=fallback, backward=None,
            reason=f"auto: {fallback.value} (deterministic mode: FA4's backward is not deterministic on this "
            "mask for every rank)",
        )  # fmt: skip
        if fallback == KernelBackend.TORCH:
            return choice
    candidates = [
        name
        for name, ok in (
            ("fa4", choice.fa4_everywhere),
            ("cudnn", choice.cudnn_everywhere),
            ("triton", choice.triton_everywhere and magi_ffa.triton_head_dim_ok(head_dim)),
        )
        if ok
    ]
    table = load_kernel_table(choice.gpu_kind)
    if table is None:
        reason = f"auto: no measured kernel table for GPU kind {choice.gpu_kind!r}; the capability rule ({choice.reason})"
        return dataclasses.replace(choice, reason=reason)
    if len(candidates) < 2:
        return choice
    picked = pick_kernel(table, features(), head_dim, candidates, deterministic=deterministic)
    if picked is None:
        reason = f"auto: the {choice.gpu_kind} table has no row for head_dim {head_dim}; the capability rule"
        return dataclasses.replace(choice, reason=f"{reason} ({choice.reason})")
    forward, backward = KernelBackend(picked.forward), KernelBackend(picked.backward)
    return dataclasses.replace(
        choice,
        backend=forward,
        backward=backward if backward != forward else None,
        reason=f"auto: {picked.reason}",
    )


def _require(
    ok: bool, name: str, ranks: list[LocalCapability], reason: Callable[[LocalCapability], str]
) -> None:
    if ok:
        return
    bad = [f"rank {i}: {reason(r)}" for i, r in enumerate(ranks) if reason(r)]
    raise ValueError(f"kernel_backend='{name}' cannot run on every rank of the cp group: " + "; ".join(bad))


def _fa4_head_dim_ok(head_dim: int) -> bool:
    try:
        import magi_ffa_fa4
    except ImportError:
        return False
    return magi_ffa_fa4.head_dim_supported(head_dim)


def _cudnn_head_dim_ok(head_dim: int) -> bool:
    try:
        import magi_ffa_cudnn
    except ImportError:
        return False
    return magi_ffa_cudnn.head_dim_supported(head_dim)


_IMPORTED: set[tuple] = set()
"""(group, backends) whose kernel libraries imported on every rank of the group."""


def import_vendors(cp_group: CpGroup, choice: KernelChoice) -> None:
    """Import the kernel libraries of the choice's forward and backward backends, and only those (the
    probes read what is installed without importing it). A library that fails to import raises on every
    rank of the group, before any data moves: ImportError naming it on that rank, AgreementError (a
    ValueError) naming the rank and the library on the others. Once per group and backends."""
    names = sorted({choice.backend.value, (choice.backward or choice.backend).value})
    cache_key = (cp_group.name, cp_group.ranks, tuple(names))
    if cache_key in _IMPORTED:
        return
    error: BaseException | None = None
    for name in names:
        cap = ffa_backend(KernelBackend(name)).capability
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
            break
    if cp_group.group is not None and cp_group.size > 1:
        agree(cp_group.group, "magi_attention key: import the kernel libraries", error=error)
    elif error is not None:
        raise error
    _IMPORTED.add(cache_key)


def clear_agreements() -> None:
    _AGREED.clear()
    _IMPORTED.clear()


# -- the launchers of each backend ------------------------------------------------------------------------
def ffa_backend(backend: KernelBackend) -> FFABackend:
    """The FFA contract bound to `backend`'s kernels (`magi_ffa.contract.FFABackend`): magi_ffa's Triton or
    torch path, magi_ffa_fa4 or magi_ffa_cudnn (each package registers its backend when imported)."""
    if backend == KernelBackend.FA4:
        import magi_ffa_fa4

        return magi_ffa_fa4.BACKEND
    if backend == KernelBackend.CUDNN:
        import magi_ffa_cudnn

        return magi_ffa_cudnn.BACKEND
    if backend not in (KernelBackend.TRITON, KernelBackend.TORCH):
        raise ValueError(f"no kernel for backend {backend!r}")
    return get_backend(backend.value)


@dataclass(frozen=True, slots=True)
class AttnKernel:
    """The kernels of one call: the forward of `backend`, the backward of `backward_backend` (the same
    backend unless `auto` split the directions), both through the one FFA contract on the slices the plan
    checked once (`KernelSlices.checked`): no value checks and no host sync per call, and each backend's
    per-mask launch data (FA4's launch metadata, cuDNN's mask plan) cached on those slices."""

    backend: KernelBackend
    backward_backend: KernelBackend
    forward_impl: FFABackend
    backward_impl: FFABackend

    def fwd_slices(self, q, k, v, slices, **kw):
        """`FFABackend.fwd_checked` of the forward's backend on `slices` (a `KernelSlices`)."""
        return self.forward_impl.fwd_checked(q, k, v, _checked(slices, q, k), **kw)

    def bwd_slices(self, do, q, k, v, out, lse, slices, **kw):
        """`FFABackend.bwd_checked` of the backward's backend on `slices`."""
        return self.backward_impl.bwd_checked(do, q, k, v, out, lse, _checked(slices, q, k), **kw)

    @property
    def fwd(self) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The forward backend's `ffa_fwd` (slice tables, checked on every call)."""
        return self.forward_impl.ffa_fwd

    @property
    def bwd(self) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The backward backend's `ffa_bwd`."""
        return self.backward_impl.ffa_bwd


def _checked(slices, q: torch.Tensor, k: torch.Tensor) -> CheckedSlices:
    """The slices' `CheckedSlices` (checked now, once, when a caller built them without)."""
    if slices.checked is None:
        slices.checked = check_slices(slices.q_ranges, slices.k_ranges, slices.types, q.shape[0], k.shape[0])
    return slices.checked


@functools.cache
def attn_kernel(backend: KernelBackend, backward: KernelBackend | None = None) -> AttnKernel:
    """The kernels of `backend`, with the backward of `backward` when given."""
    backward = backend if backward is None else backward
    return AttnKernel(backend, backward, ffa_backend(backend), ffa_backend(backward))
