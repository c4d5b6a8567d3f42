"""Pieces shared by the Triton forward, backward and merge kernels: jit helpers and launch flags (the tile
table is ``_tiles.py``).

The visibility rule of a slice lives here once for the kernels: ``slice_walk`` (which tiles a block walks,
and which of them need no mask) and ``tile_visible`` (the element mask of a boundary tile), the jit twins of
``Slice.k_bounds`` / ``Slice.q_bounds`` / ``Slice.visible`` on the host; so does the out/lse merge of two
partial results (``merge_partials``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import env

LOG2E = tl.constexpr(1.4426950408889634)  # jit code reads only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)


def compute_flags(q: torch.Tensor) -> tuple[bool, bool]:
    """(UPCAST, IEEE): the interpreter cannot do bf16 math, so bf16 is loaded as fp32 there; fp32 operands
    use IEEE dots (no tf32 rounding)."""
    upcast = (not q.is_cuda) and q.dtype == torch.bfloat16
    return upcast, q.dtype == torch.float32 or upcast


@triton.jit
def tanh_(x):
    # libdevice is unavailable under the interpreter; this form saturates cleanly to +-1 (no inf/inf)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def dot_(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def load_slice(SLICES, sid):
    """Read one slice row and derive (causal?, inverse-causal?) flags."""
    sp = SLICES + sid * 8
    qs = tl.load(sp)
    qe = tl.load(sp + 1)
    ks = tl.load(sp + 2)
    ke = tl.load(sp + 3)
    typ = tl.load(sp + 4)
    dk = tl.load(sp + 5)
    dk_inv = tl.load(sp + 6)
    causal = (typ == 1) | (typ == 3)
    inv = (typ == 2) | (typ == 3)
    return qs, qe, ks, ke, dk, dk_inv, causal, inv


@triton.jit
def slice_walk(
    a0, a_lo, a_hi, x_lo, x_hi, lo_on, lo_off, up_on, up_off, A_BLOCK: tl.constexpr, X_BLOCK: tl.constexpr
):
    """The one walk of a slice, from the block of ``A_BLOCK`` owned indices at ``a0`` (q rows when walking keys,
    keys when walking q rows) along the other axis.

    The slice covers owned ``a`` in ``[a_lo, a_hi)`` and walked ``x`` in ``[x_lo, x_hi)``, cut by a lower band
    ``x >= a + lo_off`` (when ``lo_on``) and an upper band ``x <= a + up_off`` (when ``up_on``). Walking keys
    from q rows: lower = inverse-causal (``dk_inv``), upper = causal (``dk``); walking rows from keys: lower =
    causal (``-dk``), upper = inverse-causal (``-dk_inv``).

    Returns ``(start, end, n_tiles, full_lo, full_hi)``: the walked indices any owned index sees lie in
    ``[start, end)``, stepped as ``n_tiles`` tiles of ``X_BLOCK`` from ``start`` (a multiple of
    ``X_BLOCK``); tiles ``[full_lo, full_hi)`` are visible in every element (no element mask, no load mask),
    the rest are boundary tiles. Without full tiles,
    ``full_lo = full_hi = n_tiles``, so the ranges ``[0, full_lo)``, ``[full_lo, full_hi)``, ``[full_hi,
    n_tiles)`` always cover every tile once.
    """
    r_lo = tl.maximum(a_lo, a0)
    r_hi = tl.minimum(a_hi, a0 + A_BLOCK)
    first = tl.where(lo_on, tl.maximum(x_lo, r_lo + lo_off), x_lo)
    end = tl.where(up_on, tl.minimum(x_hi, r_hi + up_off), x_hi)
    # tiles on the X_BLOCK grid (as FlexAttention's blocks are): fewer boundary tiles than tiles starting at
    # `first`; indices of the first tile below `first` are >= 0 (safe to load) and masked as invisible
    start = first - first % X_BLOCK
    n_tiles = (tl.maximum(end - start, 0) + X_BLOCK - 1) // X_BLOCK
    # full tiles: every owned index inside the slice, the tile inside [x_lo, x_hi) and inside both bands for
    # the block's extreme owned indices; an interval of tile numbers (all quantities clamped >= 0 before
    # dividing, so truncating and flooring division agree)
    own_full = (a_lo <= a0) & (a0 + A_BLOCK <= a_hi)
    need_lo = tl.maximum(x_lo, tl.where(lo_on, a0 + A_BLOCK - 1 + lo_off, x_lo)) - start
    full_lo = (tl.maximum(need_lo, 0) + X_BLOCK - 1) // X_BLOCK
    full_hi = tl.maximum(x_hi - start, 0) // X_BLOCK
    full_hi = tl.where(up_on, tl.minimum(full_hi, tl.maximum(a0 + up_off + 1 - start, 0) // X_BLOCK), full_hi)
    full_hi = tl.minimum(full_hi, n_tiles)
    has_full = own_full & (full_lo < full_hi)
    return start, end, n_tiles, tl.where(has_full, full_lo, n_tiles), tl.where(has_full, full_hi, n_tiles)


@triton.jit
def tile_visible(rows, cols, qs, qe, ks, ke, dk, dk_inv, causal, inv):
    """Element visibility for broadcastable global row / key indices: inside the slice's ranges and its
    diagonal band (``k <= q + dk`` when causal, ``k >= q + dk_inv`` when inverse-causal)."""
    vis = (rows >= qs) & (rows < qe) & (cols >= ks) & (cols < ke)
    vis = vis & (~causal | (cols <= rows + dk))
    return vis & (~inv | (cols >= rows + dk_inv))


@triton.jit
def merge_partials(a, lse_a, b, lse_b):
    """Merge two partial results ``[rows, d]`` (fp32) with lse ``[rows]`` (natural log) over disjoint keys.

    A side whose lse is -inf weighs nothing and its values are selected away, never multiplied by 0 (they
    may be garbage, even NaN); rows -inf on both sides give out 0 / lse -inf.
    """
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m_safe)
    w_b = tl.exp(lse_b - m_safe)
    total = w_a + w_b
    has_keys = total > 0.0
    total_safe = tl.where(has_keys, total, 1.0)
    c_a = tl.where(has_keys, w_a / total_safe, 0.0)
    c_b = tl.where(has_keys, w_b / total_safe, 0.0)
    lse = tl.where(has_keys, m_safe + tl.log(total_safe), float("-inf"))
    out = tl.where(c_a[:, None] > 0.0, a * c_a[:, None], 0.0) + tl.where(
        c_b[:, None] > 0.0, b * c_b[:, None], 0.0
    )
    return out, lse


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised output buffer; ``MAGI_FFA_POISON=1`` (tests) fills it with NaN so unwritten rows show."""
    if env.poison():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
