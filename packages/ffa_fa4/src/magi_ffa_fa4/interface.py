"""``flex_flash_attn_func`` on FlashAttention-4: slices -> cached launch metadata -> FA4 kernels.

This package provides only FA4's launchers and its capability; the FFA contract (checks, autograd, out / lse
accumulation, sinks, max logits, empty rows, ``deterministic``) is ``magi_ffa.contract``'s, bound here as
:data:`BACKEND`. Forward and backward run FA4's kernels (``flash_attn.cute.interface._flash_attn_fwd`` /
``_flash_attn_bwd``) either as varlen calls (masks whose slices form one group of documents / windows,
:mod:`magi_ffa_fa4.varlen`) or block-sparse with an interval ``mask_mod``: the forward q->k block lists (Full
tiles unmasked, Partial tiles masked, Empty tiles skipped), the backward k->q lists, the intervals as the aux
tensor.

Deterministic mode: this backend runs FA4 4.0.0b36's deterministic backward on its varlen path only; on the
block-sparse path FA4 raises ("deterministic block-sparse backward requires dq_write_order", sm90) unless
given dQ write-order metadata (``flash_attn.cute.block_sparsity.compute_dq_write_order``), which this backend
does not build (its lock order has not been validated on a GPU here). The contract therefore
refuses ``deterministic=True`` with a ValueError, before any kernel starts, for a mask that takes the
block-sparse path, naming the backends that can (``cudnn``, ``triton``): a fixed-order varlen decomposition
of an arbitrary mask would need one group per overlapping slice, several times slower than either of those
(see ``varlen.MAX_GROUPS``). :func:`deterministic_supported` says which masks it accepts.
"""

from __future__ import annotations

import dataclasses

import torch

from magi_ffa import merge_out_lse
from magi_ffa.contract import BackendCapability, FFABackend, Launchers, register_backend
from magi_ffa.validation import CheckedSlices, RangesLike, TypeMapLike, check_slices

from . import env
from ._launch_meta import LaunchMeta, get_launch_meta, takes_varlen
from ._varlen_kernels import backward_varlen, forward_varlen

INSTALL_HINT = (
    "magi_ffa_fa4.flex_flash_attn_func needs FlashAttention-4 (CuTe DSL): install row "
    '"fa4" (python scripts/install.py fa4, docs/install.md), which pulls `flash-attn-4==4.0.0b36` and '
    "`nvidia-cutlass-dsl[cu13]`; or install those two pinned names directly: "
    '`pip install flash-attn-4==4.0.0b36 "nvidia-cutlass-dsl[cu13]"`.'
)


def fa4_available() -> bool:
    """True when flash-attn-4 and the CuTe DSL import (says nothing about a usable GPU)."""
    try:
        _fa4()
    except ImportError:
        return False
    return True


_FA4_MODULE = None


def _fa4():
    global _FA4_MODULE
    if _FA4_MODULE is not None:
        return _FA4_MODULE
    try:
        from flash_attn.cute import interface as fa4_interface

        from . import _fa4_mask  # noqa: F401  (imports cutlass)
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
    _FA4_MODULE = fa4_interface
    return fa4_interface


def head_dim_supported(head_dim: int) -> bool:
    """FA4 4.0.0b36's block-sparse path (this backend) takes head dims that are multiples of 8, at most 128."""
    return 0 < head_dim <= 128 and head_dim % 8 == 0


def _prepare(q: torch.Tensor, k: torch.Tensor, checked: CheckedSlices) -> LaunchMeta:
    """The cached launch metadata of the checked slices' mask on q's device."""
    return get_launch_meta(
        checked.q_ranges, checked.k_ranges, checked.types, checked.total_q, checked.total_k, q.device
    )


def _forward(
    q, k, v, meta: LaunchMeta, scale: float, softcap: float, want_max: bool, zero_empty: bool = True
):
    """FA4 forward (the contract's launcher): out ``[total_q, hq, d]``, lse ``[total_q, hq]`` (a transposed
    view of FA4's ``[hq, total_q]``) and None (FA4 reports no max logits).

    ``zero_empty=False`` leaves whatever the kernel wrote in the out rows of rows that see no key (their lse
    is -inf): for a result that is only merged into an accumulator, whose merge selects such rows away."""
    fa = _fa4()
    if meta.varlen is not None:
        out, lse = forward_varlen(fa, q, k, v, meta.varlen, scale, softcap)
        return out, lse.t(), None
    q4, k4, v4 = q[None], k[None], v[None]
    # tests set MAGI_FFA_FA4_POISON=1 so that any element the kernel does not write shows up as NaN
    poison = torch.full_like(q4, float("nan")) if env.poison() else None
    # a block row with no tile at all may be skipped by the kernel: pre-set its lse to -inf
    lse_buf = None
    if meta.has_empty_rows:
        lse_buf = torch.full((1, q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    out4, lse3, *_ = fa._flash_attn_fwd(
        q4,
        k4,
        v4,
        softmax_scale=scale,
        softcap=softcap,
        mask_mod=meta.mask_mod,
        block_sparse_tensors=meta.fwd_bst,
        aux_tensors=[meta.bounds],
        return_lse=True,
        out=poison,
        lse=lse_buf,
    )
    if meta.has_empty_rows and zero_empty:
        # rows that see no key: output 0 whatever the kernel left there (lse is -inf already)
        out4.index_fill_(1, meta.empty_rows, 0.0)
    return out4[0], lse3[0].t(), None


def _backward(
    do, q, k, v, out, lse, meta: LaunchMeta, scale: float, softcap: float, deterministic: bool, dlse
):
    """FA4 backward of this call's mask from a (possibly merged) out / lse ``[total_q, hq]``: dq, dk, dv in q's
    dtype. ``dlse``: fp32 ``[total_q, hq]`` or None (0 on rows whose lse is -inf)."""
    fa = _fa4()
    out = out.to(q.dtype)
    if meta.varlen is not None:
        return backward_varlen(fa, do, q, k, v, out, lse, meta.varlen, scale, softcap, deterministic, dlse)
    gq, gk, gv = fa._flash_attn_bwd(
        q[None], k[None], v[None], out[None], do[None], lse.t()[None].contiguous(), softmax_scale=scale,
        softcap=float(softcap), deterministic=bool(deterministic), mask_mod=meta.mask_mod,
        aux_tensors=[meta.bounds], block_sparse_tensors=meta.bwd_bst,
        dlse=None if dlse is None else dlse.t()[None].contiguous(),
    )[:3]  # fmt: skip
    return gq[0], gk[0], gv[0]


def _deterministic(checked: CheckedSlices) -> bool:
    return not checked.slices or takes_varlen(checked.slices, checked.total_q, checked.total_k)


def deterministic_supported(
    q_ranges: RangesLike, k_ranges: RangesLike, attn_type_map: TypeMapLike, total_q: int, total_k: int
) -> bool:
    """True when these slices take FA4's varlen path, whose backward has a deterministic mode (so
    ``deterministic=True`` is accepted); False for the block-sparse path, where it raises ValueError.

    Args:
        q_ranges: int32 ``[num_slices, 2]`` query ranges (CPU tensor or list; checked like every entry's).
        k_ranges: int32 ``[num_slices, 2]`` key ranges.
        attn_type_map: int32 ``[num_slices]`` types (or names / one type); None = all FULL.
        total_q: query tokens the ranges index.
        total_k: key tokens the ranges index.
    """
    return _deterministic(check_slices(q_ranges, k_ranges, attn_type_map, total_q, total_k))


CAPABILITY = BackendCapability(
    name="fa4",
    title="FA4",
    package="magi_ffa_fa4",
    dtypes=(torch.float16, torch.bfloat16),
    head_dim_ok=head_dim_supported,
    head_dim_rule="a multiple of 8 and at most 128",
    # FA4 4.0.0b36 runs block sparsity forward and backward on sm90 and sm100/sm110 only (its sm80 tiles do
    # not match the 128-key sparse blocks; sm120 has no block-sparse backward)
    architectures=(9, 10, 11),
    architecture_names="Hopper (sm90) or Blackwell (sm100/sm110)",
    max_logits=False,  # FA4 reports no max: the contract's QK pass on magi_ffa's Triton kernel
    deterministic=_deterministic,
    nondeterministic_masks=(
        'its slices take FA4\'s "block-sparse" path (not expressible as varlen calls), whose deterministic '
        "backward this backend does not run (flash-attn-4 4.0.0b36 needs dQ write-order metadata there)"
    ),
    install_check=lambda: _fa4(),  # the module global: tests replace it with a fake
    # read from the installed metadata, never imported, when a process asks whether it could run FA4
    requires=(("flash-attn-4", "flash_attn"), ("nvidia-cutlass-dsl", "cutlass")),
    install_hint='install row "fa4": python scripts/install.py fa4, docs/install.md',
    priority=30,  # auto without a measured row: FA4 first (then Triton, cuDNN, the torch reference)
)
"""FA4's capability: fp16/bf16, head_dim a multiple of 8 up to 128, sm90/sm100/sm110, softcap, no max logits
from the kernel, deterministic on the varlen path only."""

BACKEND = register_backend(FFABackend(CAPABILITY, Launchers(_forward, _backward, _prepare)))
"""The FFA contract bound to FA4's launchers."""

flex_flash_attn_func, ffa_fwd, ffa_bwd = BACKEND.entry_points


# The autograd path's merge is magi_ffa's (torch ops, differentiable; a -inf row's out is ignored, NaN included).
_merge_differentiable = merge_out_lse


def relaxed_capability(**changes) -> BackendCapability:
    """FA4's capability with some fields replaced (tests run the contract around a fake FA4 on the CPU)."""
    return dataclasses.replace(CAPABILITY, **changes)
