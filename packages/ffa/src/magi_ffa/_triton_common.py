"""Pieces shared by the Triton forward, backward and merge kernels: tile choice and jit helpers.

The visibility rule of a slice lives here once: ``qblock_cols`` (the keys a q block walks), ``tile_full``
(a tile needs no element mask) and ``tile_visible`` (the element mask); so does the out/lse merge of two
partial results (``merge_partials``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import env

LOG2E = tl.constexpr(1.4426950408889634)  # jit code reads only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)


@dataclass(frozen=True, slots=True)
class Tiles:
    """One kernel's launch shape: ``block_m`` rows of q, ``block_n`` rows of k/v per tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Per kernel, keyed by head_dim: (BLOCK_M, BLOCK_N, num_warps, num_stages). Hopper-first choices, checked
# with ptxas for register spills at d=128 (sm_90a) and swept on the H200 (docs/benchmarks/ffa.md):
# fwd: 128 q rows per program keep the wgmma M dimension full; 128 x 128 measured best (459 vs 452 TFLOP/s
#   for 128 x 64, full mask, 32k, 64:8) despite a small spill.
# dq: owns a q block and holds q, do and dq at once: 128 x 32 (almost no spill) beat 64 x 64 and 128 x 64.
# dkv: owns a k block (k, v, dk, dv resident) and walks q in 32-row tiles: 32 x 128 beat 32 x 64 / 64 x 64.
# fused (one backward kernel, dq by atomics; MAGI_FFA_BWD_IMPL=fused): the dkv walk plus a [BLOCK_M, d] dq
#   tile. NOT measured on a GPU yet; chosen as the spill-free configs of an offline ptxas check (sm_90a, bf16,
#   no softcap): d=128 32 x 128 / 8 warps / 1 stage (2 stages: 136 B spilled), d=64 32 x 64 / 4 warps / 2.
# d=64 / 256 entries are scaled from these, not measured.
_GPU_TILES = {
    "fwd": {64: Tiles(128, 64, 4, 3), 128: Tiles(128, 128, 8, 3), 256: Tiles(64, 32, 4, 2)},
    "dq": {64: Tiles(128, 32, 4, 2), 128: Tiles(128, 32, 8, 2), 256: Tiles(32, 32, 4, 1)},
    "dkv": {64: Tiles(32, 128, 4, 2), 128: Tiles(32, 128, 8, 2), 256: Tiles(16, 32, 4, 1)},
    "fused": {64: Tiles(32, 64, 4, 2), 128: Tiles(32, 128, 8, 1), 256: Tiles(16, 32, 4, 1)},
}
# The interpreter runs one program at a time at ~10 ms per inner iteration: large tiles, few iterations.
_INTERP_TILES = Tiles(64, 64, 4, 1)


def tiles_for(kind: str, head_dim: int, interpret: bool) -> Tiles:
    """Tiles for ``kind`` (fwd, dq, dkv, fused); ``MAGI_FFA_TILES_<KIND>="BM,BN,warps,stages"`` overrides (tests,
    tuning sweeps)."""
    forced = env.tiles(kind)
    if forced:
        return Tiles(*forced)
    if interpret:
        return _INTERP_TILES
    table = _GPU_TILES[kind]
    return table[min((d for d in table if d >= head_dim), default=max(table))]


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
def qblock_cols(qs, qe, ks, ke, dk, dk_inv, causal, inv, m0, BLOCK_M: tl.constexpr):
    """Keys ``[lo, hi)`` of one slice that any row of the q block at ``m0`` sees, and whether every row of
    the block lies inside the slice's q range."""
    r_lo = tl.maximum(qs, m0)
    r_hi = tl.minimum(qe, m0 + BLOCK_M)
    hi = tl.where(causal, tl.minimum(ke, r_hi + dk), ke)
    lo = tl.where(inv, tl.maximum(ks, r_lo + dk_inv), ks)
    return lo, hi, (qs <= m0) & (m0 + BLOCK_M <= qe)


@triton.jit
def tile_full(
    m0, n0, rows_full, cols_full, dk, dk_inv, causal, inv, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Whether every pair of the tile (rows ``[m0, m0 + BLOCK_M)``, keys ``[n0, n0 + BLOCK_N)``) is visible,
    given that its rows (``rows_full``) and keys (``cols_full``) lie inside the slice's ranges."""
    full = rows_full & cols_full
    full = full & (~causal | (n0 + BLOCK_N - 1 <= m0 + dk))
    return full & (~inv | (n0 >= m0 + BLOCK_M - 1 + dk_inv))


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
