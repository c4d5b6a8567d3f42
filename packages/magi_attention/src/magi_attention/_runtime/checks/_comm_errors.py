"""Errors from communication that say where they happened: the rank, the call, the phase and the stage.

torch.distributed reports a stalled or failed peer as a bare backend error ("Timed out waiting 1800000ms
for recv operation", "Connection closed by peer"). Every collective of the runtime runs inside
`comm_step(...)`, which re-raises such an error as `CommError` (a RuntimeError; the original error is its
`__cause__`) naming, e.g., "rank 1 of cp group 'default_pg' (2 ranks): GroupCast of stage 2 in the
backward of calc_attn", and, where the group's store can tell, the peers that did not report the same
failure within 2 s (dead, or blocked elsewhere: `magi_group_collective.agreement.unresponsive_ranks`).
The status agreement that opens every public call (`_call_agreement`) raises CommError the same way.

How long a wait lasts is the process group's timeout (`dist.init_process_group(..., timeout=...)` or
`dist.new_group(..., timeout=...)`; torch's default is 30 minutes for gloo, 10 for NCCL): the library
sets none of its own, and every one of its collectives runs on the key's group, so that timeout bounds each.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from magi_group_collective import NativeUnavailableError
from magi_group_collective.agreement import unresponsive_ranks


class CommError(RuntimeError):
    """A collective of magi_attention failed or timed out; the message names rank, call, phase and stage."""


def where(cp_group: object) -> str:
    group = getattr(cp_group, "group", None)
    rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    return (
        f"rank {rank} of cp group {getattr(cp_group, 'name', '?')!r} ({getattr(cp_group, 'size', 1)} ranks)"
    )


@contextmanager
def comm_step(cp_group: object, what: str) -> Iterator[None]:
    """Run a collective (or wait for one); a RuntimeError from it becomes a CommError naming `what`."""
    try:
        yield
    except (CommError, NativeUnavailableError):  # the latter: a setting that cannot run, raised on every rank
        raise
    except RuntimeError as exc:
        group = getattr(cp_group, "group", None)
        peers = unresponsive_ranks(group, what) if group is not None else ""
        raise CommError(
            f"{where(cp_group)}: {what} failed: {exc}\n" + (f"({peers})\n" if peers else "") + "(a peer rank "
            "failed, stopped or never reached this call; the wait is bounded by the process group's timeout)"
        ) from exc
