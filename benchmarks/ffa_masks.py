"""Benchmark masks for the FFA kernel: each as FFA slices, as a FlexAttention mask_mod, and its exact area.

Masks (total length S): full, causal, varlen_full / varlen_causal (log-normal document lengths around S/16,
each at most S/4), swa_causal_w1024 / w4096 (key k visible from query q iff q - w < k <= q), varlen
block-causal (documents, 2048-token blocks: a key is visible if it is in the same document and in the
same or an earlier block), random (random overlapping slices of all four types, disjoint areas).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

MASK_NAMES = (
    "full", "causal", "varlen_full", "varlen_causal", "swa_causal_w1024", "swa_causal_w4096",
    "varlen_block_causal", "random",
)  # fmt: skip


@dataclass(frozen=True)
class BenchMask:
    """One mask: slices (CPU int32 tensors), a Flex ``mask_mod`` (None = no mask), exact visible area."""

    name: str
    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    attn_type_map: torch.Tensor
    mask_mod: Callable | None
    area: int
    cudnn_causal: bool | None  # SDPA expresses it as (is_causal), or None if SDPA cannot


def doc_lengths(total: int, seed: int = 0) -> list[int]:
    """Long-tailed document lengths: log-normal with median total/16 (sigma 1), each in [16, total/4]."""
    rng = random.Random(seed)
    cap, out, left = total // 4, [], total
    while left > 0:
        n = int(rng.lognormvariate(math.log(total / 16), 1.0))
        n = min(left, cap, max(16, n))
        out.append(n)
        left -= n
    return out


def _t(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def slice_area(q_ranges: torch.Tensor, k_ranges: torch.Tensor, types: torch.Tensor) -> int:
    """Exact number of visible pairs (slices must have disjoint areas), counted row by row."""
    total = 0
    for (qs, qe), (ks, ke), t in zip(q_ranges.tolist(), k_ranges.tolist(), types.tolist()):
        if qe <= qs or ke <= ks:
            continue
        r = torch.arange(qs, qe, dtype=torch.int64)
        hi = torch.full_like(r, ke)
        lo = torch.full_like(r, ks)
        if t in (1, 3):
            hi = torch.minimum(hi, r + (ke - qe) + 1)
        if t in (2, 3):
            lo = torch.maximum(lo, r + (ks - qs))
        total += int((hi - lo).clamp(min=0).sum())
    return total


def build_mask(name: str, total: int, device: str = "cuda") -> BenchMask:
    """Build mask ``name`` for ``total`` tokens (Flex mask_mod tensors live on ``device``)."""
    S = total
    lens = doc_lengths(S)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    docs = list(itertools.pairwise(starts))
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
    cudnn = None
    if name == "full":
        rows, mod, cudnn = [[0, S, 0, S, 0]], None, False
    elif name == "causal":
        rows, mod, cudnn = [[0, S, 0, S, 1]], (lambda b, h, q, k: q >= k), True
    elif name == "varlen_full":
        rows = [[a, b, a, b, 0] for a, b in docs]
        mod = lambda b, h, q, k: ids[q] == ids[k]  # noqa: E731
    elif name == "varlen_causal":
        rows = [[a, b, a, b, 1] for a, b in docs]
        mod = lambda b, h, q, k: (ids[q] == ids[k]) & (q >= k)  # noqa: E731
    elif name.startswith("swa_causal_w"):
        w = int(name.removeprefix("swa_causal_w"))
        # rows [0, w): causal square; rows [w, S): keys (q - w, q] = a bi-causal band over k [1, S)
        rows = [[0, min(w, S), 0, min(w, S), 1]] + ([[w, S, 1, S, 3]] if S > w else [])
        mod = lambda b, h, q, k, w=w: (q >= k) & (q - k < w)  # noqa: E731
    elif name == "varlen_block_causal":
        B = 2048
        rows = []
        for a, b in docs:
            for blk in range(a // B, (b - 1) // B + 1):
                q0, q1 = max(a, blk * B), min(b, (blk + 1) * B)
                rows.append([q0, q1, a, q1, 0])
        blk_of = torch.arange(S, device=device) // B
        mod = lambda b, h, q, k: (ids[q] == ids[k]) & (blk_of[k] <= blk_of[q])  # noqa: E731
    elif name == "random":
        rows = _random_rows(S, seed=0)
        dense = torch.zeros(S, S, dtype=torch.bool, device=device)
        for qs, qe, ks, ke, t in rows:
            i = torch.arange(qs, qe, device=device)[:, None]
            j = torch.arange(ks, ke, device=device)[None, :]
            m = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=device)
            if t in (1, 3):
                m &= j <= i + (ke - qe)
            if t in (2, 3):
                m &= j >= i + (ks - qs)
            dense[qs:qe, ks:ke] |= m
        mod = lambda b, h, q, k: dense[q, k]  # noqa: E731
    else:
        raise ValueError(f"unknown mask {name!r}; choose from {MASK_NAMES}")
    qr, kr, tm = _t(rows)
    return BenchMask(name, qr, kr, tm, mod, slice_area(qr, kr, tm), cudnn)


def _random_rows(S: int, seed: int) -> list[list[int]]:
    """Random overlapping slices: q and k cut into 16 bands at 128-token granularity, each (q band, k band)
    cell holds a slice with probability 0.3 (random type, sub-range); disjoint areas."""
    rng = random.Random(seed)

    def bands() -> list[tuple[int, int]]:
        pts = sorted({0, S, *(128 * rng.randrange(1, S // 128) for _ in range(15))})
        return list(itertools.pairwise(pts))

    rows = []
    for q0, q1 in bands():
        for k0, k1 in bands():
            if rng.random() < 0.3:
                t = rng.randrange(4)
                if t == 3 and (q1 - q0) > (k1 - k0):
                    t = 1
                rows.append([q0, q1, k0, k1, t])
    rng.shuffle(rows)
    return rows
