"""The fail-fast memory check before planning: `check_plan_fits(...)` compares the metadata a dispatch over
`total_seqlen` tokens needs (a permutation of every token, its inverse, per-chunk solver state) with the memory
available now; a plan that cannot fit raises at once with the estimate instead of planning for seconds and
then running out of memory. (The byte bound of the runtime cache itself, `cache.runtime_nbytes`, sits with
the cache it bounds.)
"""

from __future__ import annotations

import math
import os

from magi_solver import padded_seqlen

_PER_CHUNK_PLAN_BYTES = 256  # solver state per dispatch chunk (partitions, heaps, areas)


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def plan_metadata_bytes(total_seqlen: int, cp_size: int, chunk_size: int) -> int:
    """Host bytes the dispatch metadata of `total_seqlen` tokens needs (permutation, its inverse while it is
    built, per-chunk solver state), before the mask's own slices."""
    padded = padded_seqlen(total_seqlen, cp_size, chunk_size)
    num_chunks = padded // chunk_size
    return 3 * 8 * padded + num_chunks * _PER_CHUNK_PLAN_BYTES


def check_plan_fits(total_seqlen: int, cp_size: int, chunk_size: int, what: str = "total_seqlen") -> None:
    """Raise MemoryError at once, with the estimate, when the plan's metadata cannot fit in this host's
    available memory (the estimate is linear in the token count: a permutation of every token)."""
    if cp_size <= 1:
        return
    need = plan_metadata_bytes(total_seqlen, cp_size, chunk_size)
    avail = _available_host_bytes()
    if avail is not None and need > avail:
        raise MemoryError(
            f"{what}={total_seqlen} with cp_size={cp_size} and chunk_size={chunk_size}: the plan's dispatch "
            f"metadata needs about {need / 2**30:.1f} GiB of host memory ({math.ceil(total_seqlen / chunk_size)} "
            f"chunks, an int64 permutation of every token and its inverse) but only {avail / 2**30:.1f} GiB are "
            "available; check total_seqlen (it must be the real number of tokens) or raise chunk_size"
        )
