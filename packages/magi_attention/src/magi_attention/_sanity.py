"""Input checks that every rank agrees on, so one rank's bad input never leaves the others hanging.

By default each rank validates its own arguments before the first collective; since keys and shapes are
usually computed the same way on every rank, bad input then fails on every rank. When only some ranks
could be wrong (data-dependent shapes), set `MAGI_ATTENTION_SANITY_CHECK=1`: the ranks then exchange one
flag (a tiny all-reduce, which syncs the host, hence off by default) and all raise together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .env import sanity_check_enabled


def device_of(x: object) -> torch.device:
    """Device for the sanity flag: the tensor's, or the CPU when the argument is not a tensor."""
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def validate_on_all_ranks(
    check: Callable[[], None], group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Run `check` (which raises ValueError/TypeError); in sanity mode make every rank raise if any rank does."""
    if group is None or not sanity_check_enabled():
        check()
        return
    error: Exception | None = None
    try:
        check()
    except (ValueError, TypeError) as exc:
        error = exc
    flag_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=flag_device)
    dist.all_reduce(failed, group=group)
    if error is not None:
        raise error
    if int(failed.item()):
        raise ValueError(
            f"{int(failed.item())} other rank(s) of the cp group rejected their input (see their error); "
            "this rank stops too instead of waiting in a collective"
        )
