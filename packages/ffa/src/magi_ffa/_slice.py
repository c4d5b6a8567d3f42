"""``Slice``: one slice as the kernels read it (trimmed rows, diagonal offsets), on the host.

The lowest module of the package: validation (``_common``), the union rewrite (``_disjoint``), the tile
metadata (``_meta``) and the launchers all build on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from magi_mask import AttnMaskType


@dataclass(frozen=True, slots=True)
class Slice:
    """One non-empty slice after trimming rows that see no key (host ints, half-open ranges).

    ``q_start``/``q_end`` are the *effective* query rows (a CAUSAL slice with ``sq > sk`` loses its first
    ``sq - sk`` rows); ``dk = k_end - q_end`` and ``dk_inv = k_start - q_start`` are the diagonal offsets:
    global key ``c`` is visible from global row ``r`` iff ``c <= r + dk`` (causal part) and ``c >= r +
    dk_inv`` (inverse-causal part), intersected with ``[k_start, k_end)``.
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    attn_type: AttnMaskType
    dk: int
    dk_inv: int

    def __post_init__(self) -> None:
        assert 0 <= self.q_start < self.q_end and 0 <= self.k_start < self.k_end, f"empty slice {self}"

    @property
    def is_causal(self) -> bool:
        return self.attn_type.is_causal

    @property
    def is_inv_causal(self) -> bool:
        return self.attn_type.is_inv_causal

    def k_bounds(self, r0: int, r1: int) -> tuple[int, int]:
        """Key range ``[lo, hi)`` visible from any row in ``[r0, r1)`` (clipped to this slice)."""
        lo, hi = self.k_start, self.k_end
        if self.is_causal:
            hi = min(hi, r1 - 1 + self.dk + 1)
        if self.is_inv_causal:
            lo = max(lo, r0 + self.dk_inv)
        return lo, hi

    def visible(self, rows, cols):
        """Element visibility for broadcastable global row / key index arrays (torch or numpy): inside the
        slice's ranges and its diagonal band. The kernels' twin is ``_triton_common.tile_visible``."""
        vis = (rows >= self.q_start) & (rows < self.q_end) & (cols >= self.k_start) & (cols < self.k_end)
        if self.is_causal:
            vis = vis & (cols <= rows + self.dk)
        if self.is_inv_causal:
            vis = vis & (cols >= rows + self.dk_inv)
        return vis

    def q_bounds(self, c0: int, c1: int) -> tuple[int, int]:
        """Query range ``[lo, hi)`` that sees any key in ``[c0, c1)`` (clipped to this slice)."""
        lo, hi = self.q_start, self.q_end
        if self.is_causal:
            lo = max(lo, c0 - self.dk)
        if self.is_inv_causal:
            hi = min(hi, c1 - 1 - self.dk_inv + 1)
        return lo, hi


def make_slice(qs: int, qe: int, ks: int, ke: int, t: int) -> Slice | None:
    """Trim one raw slice to its non-empty rows; ``None`` when it covers no (query, key) pair."""
    sq, sk = qe - qs, ke - ks
    if sq <= 0 or sk <= 0:
        return None
    at = AttnMaskType.from_any(t)
    # the diagonals are anchored to the untrimmed corners: causal to (q_end, k_end), inverse to the start
    dk, dk_inv = ke - qe, ks - qs
    if at == AttnMaskType.CAUSAL:
        qs = max(qs, qe - sk)  # bottom-right aligned: the first sq - sk rows are empty
    elif at == AttnMaskType.INV_CAUSAL:
        qe = min(qe, qs + sk)  # top-left aligned: rows past sk are empty
    elif at == AttnMaskType.BI_CAUSAL and sq > sk:
        return None
    return Slice(qs, qe, ks, ke, at, dk=dk, dk_inv=dk_inv)
