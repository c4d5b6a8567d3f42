"""Input checks shared by the metadata builders and the attention entry point.

Glossary (used in every docstring of this package):

- ``total_q`` / ``total_k``: number of query / key tokens (packed, no batch axis).
- ``num_heads_q`` / ``num_heads_kv``: query / key-value heads, ``num_heads_q % num_heads_kv == 0`` (GQA/MQA).
- ``head_dim``: the per-head feature size, equal for q, k and v.
- slice ``i``: query rows ``[q_ranges[i, 0], q_ranges[i, 1])`` attend to key rows ``[k_ranges[i, 0],
  k_ranges[i, 1])`` with the shape ``attn_type_map[i]`` (:class:`AttnType`). The mask is the **union** of
  the slices: a (query, key) pair covered by several slices is visible once.
- row intervals: for each query row, the sorted, merged, disjoint half-open key intervals it sees.
- tile ``(m, n)``: query rows ``[m * block_m, (m + 1) * block_m)`` x keys
  ``[n * block_n, (n + 1) * block_n)``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

RangesLike = torch.Tensor | Sequence[Sequence[int]]
TypeMapLike = torch.Tensor | Sequence[int] | None


class AttnType(enum.IntEnum):
    """Shape of one slice's visible region (local row ``i``, local column ``j``, sizes ``sq``, ``sk``).

    ``FULL`` (all pairs), ``CAUSAL`` (bottom-right aligned: ``j <= i + sk - sq``), ``INV_CAUSAL`` (top-left
    aligned: ``j >= i``), ``BI_CAUSAL`` (both). For ``sq=3, sk=4``::

        FULL     CAUSAL   INV_CAUSAL  BI_CAUSAL
        1111     1100     1111        1100
        1111     1110     0111        0110
        1111     1111     0011        0011
    """

    FULL = 0
    CAUSAL = 1
    INV_CAUSAL = 2
    BI_CAUSAL = 3


def _fail(msg: str) -> None:
    raise ValueError(msg)


def as_ranges(x: RangesLike, name: str, device: torch.device) -> torch.Tensor:
    """Return ``x`` as a contiguous int32 ``[num_slices, 2]`` tensor on ``device``."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.int32, torch.int64):
            _fail(f"`{name}` must be an int32 tensor of shape [num_slices, 2], got dtype {x.dtype}")
        if x.ndim == 1 and x.numel() == 0:
            x = x.reshape(0, 2)
        if x.ndim != 2 or x.shape[1] != 2:
            _fail(f"`{name}` must have shape [num_slices, 2], got {tuple(x.shape)}")
        return x.to(device=device, dtype=torch.int32).contiguous()
    try:
        t = torch.tensor([list(r) for r in x], dtype=torch.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"`{name}` must be a [num_slices, 2] int tensor or list of pairs: {e}") from None
    if t.numel() == 0:
        t = t.reshape(0, 2)
    if t.ndim != 2 or t.shape[1] != 2:
        _fail(f"`{name}` must be a list of (start, end) pairs, got shape {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int32)


def as_type_map(x: TypeMapLike, n: int, device: torch.device) -> torch.Tensor:
    """Return ``attn_type_map`` as a contiguous int32 ``[num_slices]`` tensor (``None`` means all FULL)."""
    if x is None:
        return torch.zeros(n, dtype=torch.int32, device=device)
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.tensor(list(x), dtype=torch.int64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"`attn_type_map` must be an int tensor or list of ints: {e}") from None
    if x.dtype not in (torch.int32, torch.int64):
        _fail(f"`attn_type_map` must be an int32 tensor of shape [num_slices], got dtype {x.dtype}")
    if x.ndim != 1 or x.shape[0] != n:
        _fail(f"`attn_type_map` must have shape [{n}] (one type per slice), got {tuple(x.shape)}")
    return x.to(device=device, dtype=torch.int32).contiguous()


def check_slices(
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, type_map: torch.Tensor, total_q: int, total_k: int
) -> None:
    """Raise ValueError naming the first bad slice (one vectorized check, one host sync)."""
    if not isinstance(total_q, int) or not isinstance(total_k, int) or total_q < 0 or total_k < 0:
        _fail(f"`total_q` and `total_k` must be ints >= 0, got {total_q!r} and {total_k!r}")
    n = q_ranges.shape[0]
    if k_ranges.shape[0] != n:
        _fail(
            f"`q_ranges` and `k_ranges` must have the same number of slices, got {n} and {k_ranges.shape[0]}"
        )
    if n == 0:
        return
    bad_q = (q_ranges[:, 0] < 0) | (q_ranges[:, 0] > q_ranges[:, 1]) | (q_ranges[:, 1] > total_q)
    bad_k = (k_ranges[:, 0] < 0) | (k_ranges[:, 0] > k_ranges[:, 1]) | (k_ranges[:, 1] > total_k)
    bad_t = (type_map < 0) | (type_map > 3)
    flags = torch.stack([bad_q.any(), bad_k.any(), bad_t.any()]).tolist()
    if not any(flags):
        return
    for name, bad, bound, ranges in (
        ("q_ranges", bad_q, f"total_q={total_q}", q_ranges),
        ("k_ranges", bad_k, f"total_k={total_k}", k_ranges),
    ):
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            s, e = ranges[i].tolist()
            _fail(f"`{name}[{i}]` = [{s}, {e}) must satisfy 0 <= start <= end <= {bound}")
    i = int(bad_t.nonzero()[0, 0])
    _fail(
        f"`attn_type_map[{i}]` = {int(type_map[i])} must be 0 (FULL), 1 (CAUSAL), 2 (INV_CAUSAL) "
        "or 3 (BI_CAUSAL)"
    )


def check_block(name: str, value: object) -> int:
    """Return a positive int tile size or raise ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        _fail(f"`{name}` must be a positive int, got {value!r}")
    return value
