"""Which registered backend runs a call: one generic choice on the backends' capabilities.

Every kernel backend states what it takes once, in its :class:`~magi_ffa.contract.BackendCapability`
(dtypes, head dims, softcap, determinism, whether this process can run it, its priority for ``auto``). A
caller that must pick among several (the magi_attention runtime, agreeing on one backend across ranks) asks
here instead of writing per-backend rules: :func:`known_backends` / :func:`load_backend` find the backends
(a shipped kernel package registers its backend when imported, without importing its vendor),
:func:`usable_backends` lists what this process can run (no vendor is imported to find out), :func:`choose`
picks among the candidates every rank can run.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence

import torch

from ._common import CheckedSlices, KernelBackend
from .contract import _REGISTRY, BackendCapability, FFABackend

__all__ = ["choose", "known_backends", "load_backend", "refusal", "registered_backends", "usable_backends"]

AUTO = "auto"


def registered_backends() -> list[str]:
    """The names of the registered backends, sorted (``triton`` / ``torch``, and ``fa4`` / ``cudnn`` or any
    other once their package is imported)."""
    return sorted(_REGISTRY)


def load_backend(name: str) -> FFABackend | None:
    """The backend registered as ``name``; a kernel package named ``magi_ffa_<name>`` that is installed but not
    imported yet is imported first (it registers its backend; its vendor's modules are not imported). None
    when there is no such backend (or its package does not import)."""
    backend = _REGISTRY.get(name)
    if backend is not None or not name.isidentifier():
        return backend
    module = f"magi_ffa_{name}"
    try:
        if importlib.util.find_spec(module) is None:
            return None
        importlib.import_module(module)
    except ImportError:
        return None
    return _REGISTRY.get(name)


def known_backends() -> list[str]:
    """The sorted names of every backend this process knows: the registered ones, after loading the kernel
    package of each shipped backend (the members of :class:`~magi_ffa.KernelBackend`) that is installed."""
    for member in KernelBackend:
        if member != KernelBackend.AUTO:
            load_backend(member.value)
    return registered_backends()


def usable_backends(names: Sequence[str] | None = None) -> list[str]:
    """The sorted names among ``names`` (default: every registered backend) that this process can run
    (:meth:`BackendCapability.available`: installed and this GPU's architecture, nothing imported)."""
    names = registered_backends() if names is None else names
    return sorted(n for n in names if _REGISTRY[n].capability.available())


def refusal(cap: BackendCapability, dtype: torch.dtype, head_dim: int, softcap: float = 0.0) -> str:
    """Why the backend of ``cap`` cannot take inputs of ``dtype`` / ``head_dim`` / ``softcap`` (``""`` when it
    can)."""
    if dtype not in cap.dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in cap.dtypes)
        return f"{cap.title} takes {names} inputs, got {dtype}"
    if not cap.head_dim_ok(head_dim):
        return f"{cap.title} needs head_dim {cap.head_dim_rule}, got {head_dim}"
    if softcap != 0 and not cap.softcap:
        return f"{cap.title} has no soft-capping (softcap must be 0, got {softcap!r})"
    return ""


def _refusal(
    cap: BackendCapability,
    dtype: torch.dtype,
    head_dim: int,
    softcap: float,
    deterministic: bool,
    checked: CheckedSlices | None,
) -> str:
    why = refusal(cap, dtype, head_dim, softcap)
    # the capability's predicates (the verdict on slices is not kept here: the runtime's own check keeps it)
    repeatable = cap.deterministic_head_dim(head_dim) and (checked is None or cap.deterministic(checked))
    if not why and deterministic and not repeatable:
        why = f"{cap.title} has no deterministic backward for this mask at head_dim {head_dim}"
    return why


def choose(
    candidates: Sequence[str],
    *,
    requested: str = AUTO,
    dtype: torch.dtype,
    head_dim: int,
    softcap: float = 0.0,
    deterministic: bool = False,
    checked: CheckedSlices | None = None,
    on_gpu: bool | None = None,
) -> str:
    """The backend that runs inputs of ``dtype`` / ``head_dim`` with this ``softcap`` (and a deterministic
    backward where asked, on ``checked`` when the slices are known).

    Args:
        candidates: the backend names every rank can run (e.g. the intersection of each rank's
            :func:`usable_backends`); the same on every rank, so every rank chooses alike.
        requested: a backend name, or ``"auto"``: the candidate of the highest ``priority`` that takes the
            inputs. Without a GPU (``on_gpu`` False; None: this process's), ``auto`` leaves out the
            backends that need one even where they run on the CPU (Triton under ``TRITON_INTERPRET=1``).

    Raises:
        ValueError: a requested backend not among the candidates or not taking these inputs (naming why
        and the candidates that can), or ``auto`` with no candidate that can.
    """
    if requested != AUTO:
        if requested not in candidates:
            raise ValueError(
                f"kernel_backend={requested!r} cannot run on every rank (the backends every rank can run: "
                f"{sorted(candidates)})"
            )
        why = _refusal(_REGISTRY[requested].capability, dtype, head_dim, softcap, deterministic, checked)
        if why:
            can = [c for c in candidates if c != requested and not _refusal(
                _REGISTRY[c].capability, dtype, head_dim, softcap, deterministic, checked)]  # fmt: skip
            raise ValueError(
                f"kernel_backend={requested!r} cannot take this call: {why}; use {['auto', *can]}"
            )
        return requested
    gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    ranked = sorted(candidates, key=lambda n: (-_REGISTRY[n].capability.priority, n))
    for name in ranked:
        cap = _REGISTRY[name].capability
        if cap.device != "any" and not gpu:
            continue
        if not _refusal(cap, dtype, head_dim, softcap, deterministic, checked):
            return name
    raise ValueError(
        f"no backend among {sorted(candidates)} takes {dtype} inputs at head_dim {head_dim} (softcap "
        f"{softcap!r}, deterministic {deterministic})"
    )
