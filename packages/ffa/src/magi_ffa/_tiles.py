"""Launch shapes of the Triton kernels, one table per (GPU architecture, dtype class, head_dim): no autotuning on
the hot path (a first call compiles one kernel per shape and never benchmarks).

How the rows were chosen:

- ``sm90`` (Hopper), 16-bit: measured on an H200 (``benchmarks/ffa_tile_sweep.py``, 32k tokens, 64:8 heads,
  full / causal / varlen causal, in one process beside FlexAttention); see docs/benchmarks/ffa.md.
- ``sm80`` (Ampere), ``sm100`` (Blackwell datacenter), ``sm120`` (Blackwell consumer) and every fp32 row: not
  measured here (no such GPU, and fp32 is a correctness path). They start from FlexAttention's defaults for the
  same architecture and head_dim (``torch/_inductor/template_heuristics/triton.py``), which a Triton kernel of
  the same structure tolerates in registers and shared memory.

The backward is one launch with two kinds of programs (``_triton_bwd``): ``block_m1 x block_n1`` for the
programs that own a K/V block (``block_n1`` keys held, q walked ``block_m1`` rows at a time) and ``block_m2 x
block_n2`` for those that own a q block (``block_m2`` rows held, keys walked ``block_n2`` at a time).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from . import env


@dataclass(frozen=True, slots=True)
class FwdTiles:
    """Forward: ``block_m`` q rows per program, ``block_n`` keys per step; ``tma``: full tiles load K and V
    through tensor descriptors (sm90 and newer; the pointer path otherwise or when K/V are not TMA-legal)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False


@dataclass(frozen=True, slots=True)
class BwdTiles:
    """Backward: K/V-owning programs walk ``block_m1`` rows against ``block_n1`` keys; q-owning programs walk
    ``block_n2`` keys against ``block_m2`` rows. One ``num_warps`` / ``num_stages`` for the single launch.
    ``head_major``: programs ordered kv head by kv head (each head's K/V programs, then its GQA group's q
    programs, blocks fastest) rather than every K/V program first with heads fastest. ``split``: two launches,
    the K/V programs' and then the q programs', each kernel compiled for one kind of program (its own register
    budget) instead of one launch holding both."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int
    head_major: bool = True
    split: bool = False


_F, _B = FwdTiles, BwdTiles

# arch -> dtype class -> head_dim -> tiles. A head_dim between rows takes the next larger row.
# fp32 (a correctness path, not measured; see above): Hopper and Blackwell datacenter share their rows
_FWD_FP32_SM90 = {64: _F(128, 32, 4, 3), 128: _F(32, 64, 4, 3), 256: _F(32, 32, 4, 3)}
_FWD_SM80 = {
    "16bit": {64: _F(128, 64, 4, 3), 128: _F(128, 64, 8, 3), 256: _F(32, 64, 4, 3)},
    "fp32": {64: _F(128, 32, 4, 3), 128: _F(128, 32, 4, 3), 256: _F(64, 16, 4, 3)},
}


def _with_stages(rows: dict[str, dict[int, FwdTiles]], num_stages: int) -> dict[str, dict[int, FwdTiles]]:
    """The same tiles with another pipeline depth."""
    return {
        c: {d: dataclasses.replace(t, num_stages=num_stages) for d, t in r.items()} for c, r in rows.items()
    }


_FWD: dict[str, dict[str, dict[int, FwdTiles]]] = {
    "sm90": {
        "16bit": {64: _F(128, 64, 4, 3), 128: _F(128, 128, 8, 3), 256: _F(64, 32, 4, 2)},
        "fp32": _FWD_FP32_SM90,
    },
    "sm80": _FWD_SM80,
    "sm100": {
        "16bit": {64: _F(128, 128, 4, 3), 128: _F(128, 64, 8, 3), 256: _F(64, 32, 4, 3)},
        "fp32": _FWD_FP32_SM90,
    },
    # Blackwell consumer: Ampere's tiles two stages deep (less shared memory per SM than sm90 / sm100)
    "sm120": _with_stages(_FWD_SM80, 2),
}
# fp32 (a correctness path, not measured; see above): the same small backward tiles on every architecture
_BWD_FP32 = {d: _B(16, 16, 16, 16, 4, 1) for d in (64, 128, 256)}
_BWD: dict[str, dict[str, dict[int, BwdTiles]]] = {
    "sm90": {
        "16bit": {
            64: _B(64, 64, 64, 64, 4, 3),
            128: _B(64, 128, 128, 64, 8, 3),
            256: _B(32, 32, 32, 32, 4, 2),
        },
        "fp32": _BWD_FP32,
    },
    "sm80": {
        "16bit": {64: _B(64, 64, 64, 64, 4, 2), 128: _B(64, 64, 64, 64, 4, 2), 256: _B(32, 32, 32, 32, 4, 1)},
        "fp32": _BWD_FP32,
    },
    "sm100": {
        "16bit": {
            64: _B(64, 128, 128, 64, 4, 3),
            128: _B(64, 128, 128, 64, 4, 3),
            256: _B(64, 64, 64, 64, 4, 1),
        },
        "fp32": _BWD_FP32,
    },
    "sm120": {
        "16bit": {64: _B(64, 64, 64, 64, 4, 2), 128: _B(64, 64, 64, 64, 4, 1), 256: _B(32, 32, 32, 32, 4, 1)},
        "fp32": _BWD_FP32,
    },
}
# TMA (tensor descriptors) in the forward's full tiles where the hardware has it.
_TMA_ARCHS = frozenset({"sm90", "sm100"})
# The interpreter runs one program at a time at ~10 ms per inner step: large tiles, few steps.
_INTERP_FWD = FwdTiles(64, 64, 4, 1)
_INTERP_BWD = BwdTiles(64, 64, 64, 64, 4, 1)


@functools.lru_cache(maxsize=16)
def gpu_arch(device_index: int) -> str:
    """The table's architecture key of a CUDA device: sm80 (Ampere, Ada), sm90, sm100, sm120 (and newer)."""
    major, _ = torch.cuda.get_device_capability(device_index)
    if major >= 11:
        return "sm120"
    return {9: "sm90", 10: "sm100"}.get(major, "sm80")


def _row(table: dict[int, object], head_dim: int):
    return table[min((d for d in table if d >= head_dim), default=max(table))]


def _dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def fwd_tiles(q: torch.Tensor) -> FwdTiles:
    """Forward tiles for ``q`` (``[total_q, heads, head_dim]``); ``MAGI_FFA_TILES_FWD`` overrides."""
    forced = env.tiles("fwd")
    if forced:
        return FwdTiles(*forced[:4], tma=bool(forced[4]) if len(forced) > 4 else False)
    if not q.is_cuda:
        return _INTERP_FWD
    arch = gpu_arch(q.device.index or 0)
    row = _row(_FWD[arch][_dtype_class(q.dtype)], q.shape[-1])
    return (
        row
        if arch not in _TMA_ARCHS
        else FwdTiles(row.block_m, row.block_n, row.num_warps, row.num_stages, True)
    )


def bwd_tiles(q: torch.Tensor) -> BwdTiles:
    """Backward tiles for ``q``; ``MAGI_FFA_TILES_BWD`` overrides."""
    forced = env.tiles("bwd")
    if forced:
        return BwdTiles(
            *forced[:6],
            head_major=bool(forced[6]) if len(forced) > 6 else True,
            split=bool(forced[7]) if len(forced) > 7 else False,
        )
    if not q.is_cuda:
        return _INTERP_BWD
    return _row(_BWD[gpu_arch(q.device.index or 0)][_dtype_class(q.dtype)], q.shape[-1])
