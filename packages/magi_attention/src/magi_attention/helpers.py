"""Small helpers MagiAttention users call around the keys: padding arithmetic, batch <-> packed layouts, the
slice forms of sliding windows and packed documents, the cu_seqlens check (`cu_seqlens_list`) and the
gradient sum over the cp group (`all_reduce_gradients`) the integrations share."""

from __future__ import annotations

import itertools
import numbers
from typing import Any

import torch
import torch.distributed as dist
from magi_mask import decompose_region, tighten_region

from magi_solver import AttnMaskType, AttnRanges, padded_seqlen


def _positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")
    return value


def compute_pad_size(total_seqlen: int, cp_size: int, chunk_size: int) -> int:
    """Tokens appended so that the sequence splits into whole chunks, the same number per rank.

    Args:
        total_seqlen: tokens of the (packed) sequence.
        cp_size: ranks of the context-parallel group.
        chunk_size: tokens per dispatch chunk.

    Returns:
        `ceil(total_seqlen / (chunk_size * cp_size)) * chunk_size * cp_size - total_seqlen` (>= 0).
    """
    total = _positive(total_seqlen, "total_seqlen")
    return padded_seqlen(total, _positive(cp_size, "cp_size"), _positive(chunk_size, "chunk_size")) - total


def squash_batch_dim(x: torch.Tensor) -> torch.Tensor:
    """`[batch, seqlen, ...]` -> `[batch * seqlen, ...]` (a view when possible): a batch as one packed sequence.

    Args:
        x: a tensor with at least two dimensions (batch first, then tokens).
    """
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        raise ValueError(
            f"`x` must be a tensor of at least 2 dims [batch, seqlen, ...], got {getattr(x, 'shape', x)}"
        )
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def infer_varlen_mask_from_batch(
    batch_size: int, seqlen: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cu_seqlens` of a batch packed by `squash_batch_dim`: each sample is one document.

    Args:
        batch_size: samples in the batch.
        seqlen: tokens per sample.
        device: where the returned tensors live.

    Returns:
        `(cu_seqlens_q, cu_seqlens_k)`, int32 `[batch_size + 1]`: `0, seqlen, 2 * seqlen, ...` (equal tensors).
    """
    b, s = _positive(batch_size, "batch_size"), _positive(seqlen, "seqlen")
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
    return cu, cu.clone()


def _window_bound(w: int, name: str) -> int | None:
    if isinstance(w, bool) or not isinstance(w, int) or w < -1:
        raise ValueError(f"`{name}` entries must be ints >= 0, or -1 for unbounded, got {w!r}")
    return None if w == -1 else w


def infer_attn_mask_from_sliding_window(
    q_range: Any, k_range: Any, window_size: tuple[int, int]
) -> tuple[AttnRanges, AttnRanges, list[AttnMaskType]]:
    """The exact slices of one sliding-window block (at most three: a CAUSAL head, a band, an INV_CAUSAL tail).

    Args:
        q_range: `[start, end)` of the queries.
        k_range: `[start, end)` of the keys.
        window_size: `(left, right)` as in FlashAttention, -1 = unbounded: local query row i sees local key
            j when `i + d - left <= j <= i + d + right`, with `d = len(k_range) - len(q_range)` (the diagonal
            aligned at the bottom-right, so `(-1, 0)` is CAUSAL and `(-1, -1)` FULL).

    Returns:
        `(q_ranges, k_ranges, attn_mask_types)`, empty when the window sees nothing.
    """
    (qs, qe), (ks, ke) = (_pair(r, n) for r, n in ((q_range, "q_range"), (k_range, "k_range")))
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"`window_size` must be a (left, right) pair, got {window_size!r}") from None
    left, right = _window_bound(left, "window_size"), _window_bound(right, "window_size")
    return _typed_ranges(_window_slices(qs, qe, ks, ke, left, right))


def _window_slices(
    qs: int, qe: int, ks: int, ke: int, left: int | None, right: int | None, k_end: int | None = None
):
    """Typed slices of the window `(left, right)` (None = unbounded) of one block, its diagonal at the
    bottom-right of `[qs, qe) x [ks, ke)`; `k_end` cuts the keys (a global prefix) without moving the diagonal."""
    shift = ks - qs + (ke - ks) - (qe - qs)  # k - q on the bottom-right diagonal
    end = ke if k_end is None else min(ke, k_end)
    lo = ks - qe + 1 if left is None else shift - left
    hi = end - 1 - qs if right is None else shift + right
    region = tighten_region(qs, qe, ks, end, lo, hi)
    return [] if region is None else decompose_region(region)


def _typed_ranges(slices) -> tuple[AttnRanges, AttnRanges, list[AttnMaskType]]:
    return (
        AttnRanges.from_ranges([[a, b] for a, b, _, _, _ in slices]),
        AttnRanges.from_ranges([[c, d] for _, _, c, d, _ in slices]),
        [AttnMaskType.from_code(t) for *_, t in slices],
    )


def infer_attn_mask_from_cu_seqlens(
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    global_window_size: int = 0,
) -> tuple[AttnRanges, AttnRanges, list[AttnMaskType], int, int]:
    """Slices of packed documents: query document i attends key document i (self- or cross-attention).

    Args:
        cu_seqlens_q: cumulative query lengths `[num_docs + 1]` from 0 (list or int tensor).
        cu_seqlens_k: cumulative key lengths, the same number of documents.
        causal: no key right of the (bottom-right aligned) diagonal; forces the window's right side to 0.
        window_size: `(left, right)` sliding window inside each document, -1 = unbounded (see
            `infer_attn_mask_from_sliding_window`).
        global_window_size: `G > 0` also lets every query see its document's first `G` keys (attention-sink
            tokens), still bounded by the window's right side; the slices may overlap (the mask is their union).

    Returns:
        `(q_ranges, k_ranges, attn_mask_types, total_seqlen_q, total_seqlen_k)`: a handful of slices per
        document (one FULL or CAUSAL slice without a window), never one per row.
    """
    cu_q, cu_k = cu_seqlens_list(cu_seqlens_q, "cu_seqlens_q"), cu_seqlens_list(cu_seqlens_k, "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must hold the same number of documents, got {len(cu_q) - 1} and "
            f"{len(cu_k) - 1}"
        )
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"`window_size` must be a (left, right) pair, got {window_size!r}") from None
    left, right = _window_bound(left, "window_size"), _window_bound(0 if causal else right, "window_size")
    if (
        isinstance(global_window_size, bool)
        or not isinstance(global_window_size, int)
        or global_window_size < 0
    ):
        raise ValueError(f"`global_window_size` must be an int >= 0, got {global_window_size!r}")
    slices = []
    for qs, qe, ks, ke in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if qs < qe and ks < ke:
            slices += _window_slices(qs, qe, ks, ke, left, right)
            if global_window_size and left is not None:  # (an unbounded left side sees the prefix already)
                slices += _window_slices(qs, qe, ks, ke, None, right, k_end=ks + global_window_size)
    q, k, t = _typed_ranges(slices)
    return q, k, t, cu_q[-1], cu_k[-1]


def _pair(r: Any, name: str) -> tuple[int, int]:
    try:
        a, b = (r.start, r.end) if hasattr(r, "start") else r
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a [start, end) pair, got {r!r}") from None
    for x in (a, b):
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"`{name}` must hold ints, got {r!r}")
    if not 0 <= a <= b:
        raise ValueError(f"`{name}` must satisfy 0 <= start <= end, got {r!r}")
    return a, b


def cu_seqlens_list(cu: Any, name: str = "cu_seqlens", *, total: int | None = None) -> list[int]:
    """Cumulative document lengths (`[0, len_0, len_0 + len_1, ...]`) checked and returned as Python ints.

    Args:
        cu: a 1-D integer tensor or a sequence of ints (numpy integers included); floats are refused, never
            truncated.
        name: the argument's name in error messages.
        total: when given, the last entry must equal it (the tokens of the packed sequence).

    Raises:
        ValueError: non-integers, fewer than 2 entries, a first entry other than 0, a decreasing entry, or a
            last entry other than `total`.
    """
    if isinstance(cu, torch.Tensor) and (
        cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool
    ):
        raise ValueError(f"{name} must hold integers, got a {cu.dtype} tensor")
    values = cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in values):
        raise ValueError(f"{name} must hold integers (floats would be truncated), got {values}")
    values = [int(x) for x in values]
    if len(values) < 2 or values[0] != 0 or any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(
            f"{name} must start at 0 and be non-decreasing with at least 2 entries, got {values}"
        )
    if total is not None and values[-1] != total:
        raise ValueError(f"{name} must end at the total token count {total}, got {values}")
    return values


def all_reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum every parameter's gradient over `group` (None: the default group), in place: replicated
    parameters trained without DDP/FSDP over the cp ranks. A parameter's `main_grad` (Megatron's fp32
    gradient buffer) is reduced instead of `grad` when it has one. Nothing happens without an initialised
    process group or on a group of one rank."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    for p in model.parameters():
        grad = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        if grad is not None:
            dist.all_reduce(grad, group=group)
