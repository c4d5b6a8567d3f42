"""Row intervals -> cuDNN flex_attention's ``mask_func``.

cuDNN describes the visible keys of query row ``r`` by ``nfunc`` (odd) nondecreasing endpoints
``F[0..nfunc)`` in ``[0, total_k]``: the keys ``[0, F0) U [F1, F2) U [F3, F4) U ...``. magi_ffa's row
intervals (:class:`magi_ffa.intervals.RowIntervals`) hold the same set as sorted, disjoint, non-touching
``[starts[r, i], ends[r, i])`` for ``i < counts[r]``. The conversion:

- when every non-empty row's first interval starts at key 0 (causal and full masks over whole sequences),
  ``F = [e0, s1, e1, ..., s_{w-1}, e_{w-1}]`` (``nfunc = 2w - 1``);
- otherwise a leading empty interval: ``F = [0, s0, e0, s1, e1, ...]`` (``nfunc = 2w + 1``).

Unused slots repeat the row's last end (empty intervals keep the endpoints nondecreasing); a row with no
interval is all zeros. The result is int32 ``[1, nfunc, total_q]`` (one mask for every head), contiguous.
"""

from __future__ import annotations

import torch

from magi_ffa.intervals import RowIntervals

__all__ = ["mask_func_from_intervals", "visible_from_mask_func"]


def mask_func_from_intervals(iv: RowIntervals) -> torch.Tensor:
    """cuDNN's int32 ``[1, nfunc, total_q]`` mask function of these row intervals (on their device).

    One host sync (whether every non-empty row starts at key 0) picks the shorter of the two encodings.
    """
    counts = iv.counts.long()
    total_q, width = iv.starts.shape
    if total_q == 0:
        return torch.zeros(1, 1, 0, dtype=torch.int32, device=iv.starts.device)
    slot = torch.arange(width, device=iv.starts.device)
    used = slot[None, :] < counts[:, None]
    # the row's last end, repeated in the unused slots (0 for rows with no interval)
    last = torch.gather(iv.ends, 1, (counts - 1).clamp(min=0)[:, None]).squeeze(1)
    last = torch.where(counts > 0, last, torch.zeros_like(last))
    starts = torch.where(used, iv.starts, last[:, None])
    ends = torch.where(used, iv.ends, last[:, None])
    pairs = torch.stack([starts, ends], dim=2).reshape(total_q, 2 * width)  # s0, e0, s1, e1, ...
    lead_zero = bool(((iv.starts[:, 0] == 0) | (counts == 0)).all())
    if lead_zero:
        func = pairs[:, 1:]  # e0, s1, e1, ...: [0, e0) is the first interval
    else:
        func = torch.cat([torch.zeros(total_q, 1, dtype=pairs.dtype, device=pairs.device), pairs], dim=1)
    return func.t().contiguous().to(torch.int32)[None]


def visible_from_mask_func(mask_func: torch.Tensor, total_k: int) -> torch.Tensor:
    """Bool ``[total_q, total_k]``: the keys ``mask_func[0]`` makes visible (tests and inspections only).

    Key ``c`` of row ``r`` is visible iff the number of endpoints ``<= c`` is even (``[0, F0)`` first).
    """
    f = mask_func[0].t().long()  # [total_q, nfunc]
    cols = torch.arange(total_k, device=f.device)
    passed = (f[:, :, None] <= cols[None, None, :]).sum(dim=1)
    return passed % 2 == 0
