"""Pieces shared by the Triton forward and backward kernels: tile choice and jit helpers."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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
    env = os.environ.get(f"MAGI_FFA_TILES_{kind.upper()}")
    if env:
        return Tiles(*(int(x) for x in env.split(",")))
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


def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised output buffer; ``MAGI_FFA_POISON=1`` (tests) fills it with NaN so unwritten rows show."""
    if os.environ.get("MAGI_FFA_POISON") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
