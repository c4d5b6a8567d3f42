"""Blockwise torch path of FFA: any device, any float dtype (float64 included), O(block x block) memory.

It is the CPU / CI / distributed-CPU backend and the style guide's reference next to the Triton kernel:
``reference.ffa_fwd`` / ``reference.ffa_bwd`` are ``magi_ffa.ffa_fwd`` / ``magi_ffa.ffa_bwd`` on this path (the
contract's launchers bound to the torch backend, without the ``backend`` argument). Compute runs in float32 for 16-bit inputs and float64 for float64 inputs. Never imports
Triton.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ._common import Slice, acc_dtype
from ._merge import merge_out_lse
from .contract import public_functions

__all__ = ["bwd_core", "ffa_bwd", "ffa_fwd", "fwd_core"]

# Rows x keys per block: large enough that the Python loop is not the bottleneck on CPU, small enough that
# a [heads, BLOCK_Q, BLOCK_K] score block stays a few MB.
BLOCK_Q = 256
BLOCK_K = 512


def _heads_view(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[rows, hk * g, d]`` -> ``[hk, g * rows, d]`` so that GQA groups become one batched matmul."""
    rows, h, d = x.shape
    g = h // hk
    return x.reshape(rows, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * rows, d)


def _heads_unview(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of :func:`_heads_view` for ``[hk, g * rows, ...]`` -> ``[rows, hk * g, ...]``."""
    hk = x.shape[0]
    tail = x.shape[2:]
    g = x.shape[1] // rows
    return (
        x.reshape(hk, g, rows, *tail).permute(2, 0, 1, *range(3, 3 + len(tail))).reshape(rows, hk * g, *tail)
    )


def _block_mask(s: Slice, r0: int, r1: int, c0: int, c1: int, device: torch.device) -> torch.Tensor | None:
    """Bool ``[r1 - r0, c1 - c0]`` visibility of one block, or None when every pair is visible."""
    r = torch.arange(r0, r1, device=device)[:, None]
    c = torch.arange(c0, c1, device=device)[None, :]
    m = s.visible(r, c)
    return None if bool(m.all()) else m


def _row_blocks(slices: tuple[Slice, ...]) -> Iterator[tuple[Slice, int, int, int, int]]:
    """``(slice, r0, r1, c_lo, c_hi)`` for every ``BLOCK_Q`` rows ``[r0, r1)`` of every slice that see a key:
    they see keys in ``[c_lo, c_hi)`` at most (the walk of the forward and the backward alike)."""
    for s in slices:
        for r0 in range(s.q_start, s.q_end, BLOCK_Q):
            r1 = min(r0 + BLOCK_Q, s.q_end)
            c_lo, c_hi = s.k_bounds(r0, r1)
            if c_lo < c_hi:
                yield s, r0, r1, c_lo, c_hi


def _key_blocks(
    k: torch.Tensor, v: torch.Tensor, c_lo: int, c_hi: int, adt: torch.dtype
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """``(c0, c1, kb, vb)`` for every ``BLOCK_K`` keys ``[c0, c1)`` of ``[c_lo, c_hi)``: their keys and values as
    ``[hk, keys, head_dim]`` in ``adt``."""
    for c0 in range(c_lo, c_hi, BLOCK_K):
        c1 = min(c0 + BLOCK_K, c_hi)
        yield c0, c1, k[c0:c1].to(adt).transpose(0, 1), v[c0:c1].to(adt).transpose(0, 1)


def _scores(qb, kb, scale: float, softcap: float):
    """Scaled (and soft-capped) scores ``[hk, g*rows, keys]`` plus tanh for the softcap backward."""
    s = torch.matmul(qb, kb.transpose(1, 2)) * scale
    if softcap > 0:
        t = torch.tanh(s / softcap)
        return t * softcap, t
    return s, None


def fwd_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slices: tuple[Slice, ...],
    scale: float,
    softcap: float,
    *,
    row_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the slices; returns out ``[total_q, num_heads_q, head_dim]`` and lse ``[total_q,
    num_heads_q]``, both in the accumulator dtype (fp32, fp64 for fp64). Rows no slice reaches: 0 / -inf.
    ``row_max`` (``[total_q, num_heads_q]``, filled with -inf by the caller) receives each row's largest
    visible scaled (soft-capped) score."""
    adt = acc_dtype(q.dtype)
    tq, hq, d = q.shape
    hk = k.shape[1]
    out = torch.zeros(tq, hq, d, dtype=adt, device=q.device)
    lse = torch.full((tq, hq), float("-inf"), dtype=adt, device=q.device)
    for s, r0, r1, c_lo, c_hi in _row_blocks(slices):
        rows = r1 - r0
        qb = _heads_view(q[r0:r1].to(adt), hk)
        m_i = torch.full((hk, qb.shape[1]), float("-inf"), dtype=adt, device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(qb)
        for c0, c1, kb, vb in _key_blocks(k, v, c_lo, c_hi, adt):
            sc, _ = _scores(qb, kb, scale, softcap)
            mask = _block_mask(s, r0, r1, c0, c1, q.device)
            if mask is not None:
                sc = sc.masked_fill(~mask.repeat(qb.shape[1] // rows, 1)[None], float("-inf"))
            m_new = torch.maximum(m_i, sc.amax(-1))
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(sc - m_safe[..., None])
            alpha = torch.exp(m_i - m_safe)
            l_i = l_i * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, vb)
            m_i = m_new
        if row_max is not None:
            row_max[r0:r1] = torch.maximum(row_max[r0:r1], _heads_unview(m_i, rows).to(row_max.dtype))
        pos = l_i > 0
        blk_lse = torch.where(pos, m_i + torch.log(torch.where(pos, l_i, torch.ones_like(l_i))), m_i)
        blk_out = acc / torch.where(pos, l_i, torch.ones_like(l_i))[..., None]
        o2, l2 = merge_out_lse(
            out[r0:r1], lse[r0:r1], _heads_unview(blk_out, rows), _heads_unview(blk_lse, rows)
        )
        out[r0:r1] = o2
        lse[r0:r1] = l2
    return out, lse


def bwd_core(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    slices: tuple[Slice, ...],
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the slices' contribution given the final lse and ``delta = rowsum(do * out) - dlse``
    (both ``[total_q, num_heads_q]``). Returns dq, dk, dv in the accumulator dtype. Rows with lse = -inf
    contribute nothing."""
    adt = acc_dtype(q.dtype)
    hk = k.shape[1]
    dq = torch.zeros(q.shape, dtype=adt, device=q.device)
    dk = torch.zeros(k.shape, dtype=adt, device=q.device)
    dv = torch.zeros(k.shape, dtype=adt, device=q.device)
    # P = exp(S - lse); an empty row (lse = -inf) must give P = 0, not exp(-inf + inf) = NaN
    lse_safe = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).to(adt)
    # empty rows: their (contract-zero) out must not turn P = 0 into NaN through delta
    delta = torch.where(torch.isneginf(lse), torch.zeros_like(delta), delta).to(adt)
    for s, r0, r1, c_lo, c_hi in _row_blocks(slices):
        rows = r1 - r0
        qb = _heads_view(q[r0:r1].to(adt), hk)
        dob = _heads_view(do[r0:r1].to(adt), hk)
        lb = _heads_view(lse_safe[r0:r1, :, None], hk)
        db = _heads_view(delta[r0:r1, :, None], hk)
        dqb = torch.zeros_like(qb)
        for c0, c1, kb, vb in _key_blocks(k, v, c_lo, c_hi, adt):
            sc, t = _scores(qb, kb, scale, softcap)
            p = torch.exp(sc - lb)
            mask = _block_mask(s, r0, r1, c0, c1, q.device)
            if mask is not None:
                p = p.masked_fill(~mask.repeat(qb.shape[1] // rows, 1)[None], 0.0)
            dp = torch.matmul(dob, vb.transpose(1, 2))
            ds = p * (dp - db)
            if t is not None:
                ds = ds * (1 - t * t)
            dqb += torch.matmul(ds, kb) * scale
            dk[c0:c1] += (torch.matmul(ds.transpose(1, 2), qb) * scale).transpose(0, 1)
            dv[c0:c1] += torch.matmul(p.transpose(1, 2), dob).transpose(0, 1)
        dq[r0:r1] += _heads_unview(dqb, rows)
    return dq, dk, dv


def _torch_backend(q: torch.Tensor, backend: object):
    from .contract import get_backend  # registered by magi_ffa._ops, imported with the package

    if backend is not None:
        raise TypeError("magi_ffa.reference's launchers take no `backend` argument (they are the torch path)")
    return get_backend("torch")


# the torch path's launchers: magi_ffa.ffa_fwd / ffa_bwd with backend="torch" (the contract's templates)
_, ffa_fwd, ffa_bwd = public_functions(_torch_backend, None, selectable=False)
ffa_fwd.__module__ = ffa_bwd.__module__ = __name__
