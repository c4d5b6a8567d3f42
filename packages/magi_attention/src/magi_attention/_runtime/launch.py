"""The launchers of each backend: the FFA contract (`magi_ffa.contract.FFABackend`) bound to a backend's
kernels, found by the backend's name (`magi_ffa.choice.load_backend`: registered, or its kernel package
imported on first use), for the forward and the backward of one call."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from magi_ffa.choice import known_backends, load_backend
from magi_ffa.contract import FFABackend
from magi_ffa.validation import CheckedSlices, check_slices

from ..config import KernelBackend


def backend_name(name: str) -> KernelBackend | str:
    """`name` as its `KernelBackend` member where it is one (the shipped backends), else the name a backend
    was registered under (`magi_ffa.contract.register_backend`)."""
    try:
        return KernelBackend(name)
    except ValueError:
        return str(name)


def ffa_backend(name: str) -> FFABackend:
    """The FFA contract bound to backend `name`'s kernels (its kernel package imported where needed)."""
    backend = load_backend(str(name))
    if backend is None:
        raise ValueError(f"no kernel backend named {str(name)!r} (known: {', '.join(known_backends())})")
    return backend


@dataclass(frozen=True, slots=True)
class AttnKernel:
    """The kernels of one call: the forward of `backend`, the backward of `backward_backend` (the same
    backend unless `auto` split the directions), both through the one FFA contract on the slices the plan
    checked once (`KernelSlices.checked`): no value checks and no host sync per call, and each backend's
    per-mask launch data (and its determinism verdict) cached on those slices."""

    backend: KernelBackend | str
    backward_backend: KernelBackend | str
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
def attn_kernel(backend: str, backward: str | None = None) -> AttnKernel:
    """The kernels of `backend` (any registered name), with the backward of `backward` when given."""
    forward, backward = backend_name(backend), backend_name(backend if backward is None else backward)
    return AttnKernel(forward, backward, ffa_backend(forward), ffa_backend(backward))
