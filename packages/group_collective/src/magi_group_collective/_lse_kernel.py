"""The log-sum-exp merge kernel of GroupReduce, one for both paths: the all-to-all-v path reads its
contributions from one received tensor, the native path from the ranks' symmetric buffers.

Output row ``o`` (= ``touched[t]``) and head ``h`` merge their own ``(out, out_lse)`` with the CSR
contributions ``ptr[t] .. ptr[t + 1]`` in that order (deterministic, no atomics). Contribution ``k`` is row
``c_row[k]`` of a ``[R, H, D]`` tensor and its ``[R, H]`` lse:

- ``PEERS`` False: of ``base`` / ``lbase`` themselves (the received rows of the all-to-all-v path);
- ``PEERS`` True: of rank ``c_src[k]``'s staging slot (element ``deltas[p] * UNIT + slot`` of ``base``,
  ``deltas[p] * LUNIT + lslot`` of ``lbase``), or of this rank's own input at ``in_delta`` / ``in_lse_delta``
  when ``c_src[k] == me`` (see ``_native_kernels`` for the addressing).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _contribution(
    k, h, H, D, c_src, c_row, deltas, me, in_delta, in_lse_delta, slot, lslot,
    UNIT: tl.constexpr, LUNIT: tl.constexpr, PEERS: tl.constexpr,
):  # fmt: skip
    """Element offsets of contribution ``k``'s lse (in ``lbase``) and of its row of head ``h`` (in ``base``)."""
    r = tl.load(c_row + k).to(tl.int64)
    if PEERS:
        s = tl.load(c_src + k)
        d = tl.load(deltas + s).to(tl.int64)
        lse_at = tl.where(s == me, in_lse_delta, d * LUNIT + lslot) + r * H + h
        row_at = tl.where(s == me, in_delta, d * UNIT + slot) + (r * H + h) * D
    else:
        lse_at = r * H + h
        row_at = (r * H + h) * D
    return lse_at, row_at


@triton.jit
def lse_reduce_kernel(
    base, lbase, out, out_lse, deltas, touched, ptr, c_src, c_row, H, D, me, in_delta, in_lse_delta, slot,
    lslot, UNIT: tl.constexpr, LUNIT: tl.constexpr, PEERS: tl.constexpr, ACC: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    o = tl.load(touched + t).to(tl.int64)
    start = tl.load(ptr + t)
    end = tl.load(ptr + t + 1)
    l0 = tl.load(out_lse + o * H + h).to(ACC)
    # pass 1: the merged log-sum-exp (max-shifted; -inf terms have weight 0, all -inf gives -inf)
    m = l0
    for k in range(start, end):
        lse_at, _ = _contribution(
            k, h, H, D, c_src, c_row, deltas, me, in_delta, in_lse_delta, slot, lslot, UNIT, LUNIT, PEERS
        )
        m = tl.maximum(m, tl.load(lbase + lse_at).to(ACC))
    m_safe = tl.where(m == float("-inf"), 0.0, m).to(ACC)
    sm = tl.exp(l0 - m_safe)
    for k in range(start, end):
        lse_at, _ = _contribution(
            k, h, H, D, c_src, c_row, deltas, me, in_delta, in_lse_delta, slot, lslot, UNIT, LUNIT, PEERS
        )
        sm += tl.exp(tl.load(lbase + lse_at).to(ACC) - m_safe)
    empty = sm == 0
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, sm).to(ACC))).to(ACC)
    lse_safe = tl.where(empty, 0.0, lse).to(ACC)
    w0 = tl.exp(l0 - lse_safe)
    # pass 2: weighted sum of the partial outputs, one head_dim chunk at a time
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        o0 = tl.load(out + (o * H + h) * D + cols, mask=cmask, other=0)
        acc = tl.where(w0 > 0, o0.to(ACC) * w0, 0.0).to(ACC)
        for k in range(start, end):
            lse_at, row_at = _contribution(
                k, h, H, D, c_src, c_row, deltas, me, in_delta, in_lse_delta, slot, lslot, UNIT, LUNIT, PEERS
            )
            wk = tl.exp(tl.load(lbase + lse_at).to(ACC) - lse_safe)
            x = tl.load(base + row_at + cols, mask=cmask, other=0).to(ACC)
            acc += tl.where(wk > 0, x * wk, 0.0).to(ACC)
        res = tl.where(empty, o0, acc.to(out.dtype.element_ty))
        tl.store(out + (o * H + h) * D + cols, res, mask=cmask)
    tl.store(out_lse + o * H + h, lse.to(tl.float32))
