"""The call objects of the FFA contract's eager path (:mod:`magi_ffa.contract`).

A public call is checked once and then travels as one frozen :class:`FFACall` (the tensors, the mask's entry
of :data:`magi_ffa.mask_cache.MASKS`, the resolved scalars and flags) to the forward and backward, instead of
a dozen positional values; :class:`Options` is what the caller asked for before the checks, :class:`BwdIO` the
backward's own tensors. The ``torch.library`` custom ops keep their flat schema (torch requires one) and
rebuild an :class:`FFACall` from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import CheckedSlices, RangesLike, TypeMapLike
from .mask_cache import MASKS

__all__ = ["BwdIO", "FFACall", "Options", "checked_of"]


@dataclass(frozen=True, slots=True)
class Options:
    """The settings of a public call as given (checked by the contract): ``softmax_scale`` (None: the
    default), ``softcap``, ``deterministic``, ``sink`` (``[num_sink, num_heads_q]`` or None) and
    ``return_max_logits``."""

    softmax_scale: float | None = None
    softcap: float = 0.0
    deterministic: bool = False
    sink: torch.Tensor | None = None
    return_max_logits: bool = False


@dataclass(frozen=True, slots=True)
class FFACall:
    """One checked call: q ``[total_q, num_heads_q, head_dim]``, k / v ``[total_k, num_heads_kv, head_dim]``,
    the mask's :class:`~magi_ffa.validation.CheckedSlices` (its entry of the mask cache), the softmax scale
    and softcap (floats), the deterministic flag, the sinks (or None) and whether the max logits are
    wanted."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    checked: CheckedSlices
    scale: float
    softcap: float = 0.0
    deterministic: bool = False
    sink: torch.Tensor | None = None
    want_max: bool = False

    @property
    def runs(self) -> bool:
        """Whether a kernel has anything to compute (a slice, query rows, keys, heads)."""
        q, k = self.q, self.k
        return bool(self.checked.slices) and q.shape[0] > 0 and k.shape[0] > 0 and q.shape[1] > 0


@dataclass(frozen=True, slots=True)
class BwdIO:
    """The backward's tensors besides the call's: ``do`` (q's shape and dtype), the FINAL ``out`` / ``lse``,
    the final lse's gradient ``dlse`` (or None) and optional gradient accumulators ``dq`` / ``dk`` / ``dv``."""

    do: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dlse: torch.Tensor | None = None
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None

    @property
    def grads(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.dq, self.dk, self.dv


def checked_of(
    tables: tuple[RangesLike, RangesLike, TypeMapLike], q: torch.Tensor, k: torch.Tensor
) -> CheckedSlices:
    """The mask cache's entry of ``tables`` for q / k's token counts and device (one lookup: by the tables'
    identity, else their value; a new mask is checked, ValueError naming the bad table)."""
    return MASKS.lookup(tables, total_q=q.shape[0], total_k=k.shape[0], device=q.device)
