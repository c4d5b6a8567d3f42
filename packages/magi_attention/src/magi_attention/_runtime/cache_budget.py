"""Memory accounting of plans: the byte bound of the runtime cache and the fail-fast check before planning.

Both estimates are deterministic functions of the key and of the plan, which every rank holds identically,
so every rank computes the same sizes and evicts the same entries (evictions must match across ranks: a
rank that re-plans a key the others still hold would take part in a collective the others skip).

- `runtime_nbytes(layout, plan)`: host bytes of a plan (its Python objects and numpy arrays) plus the
  device tensors one device holds for it (index tensors, GroupCast tables), counted in full up front even
  though the device part is built lazily.
- `check_plan_fits(...)`: before any planning, the metadata a dispatch over `total_seqlen` tokens needs
  (a permutation of every token, its inverse, per-chunk solver state) against the memory available now;
  a plan that cannot fit raises at once with the estimate instead of planning for seconds and then running
  out of memory.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from magi_solver import padded_seqlen

_INT_BYTES = 32  # a Python int object plus the pointer that holds it
_SEQ_BYTES = 56  # tuple / list header
_PER_CHUNK_PLAN_BYTES = 256  # solver state per dispatch chunk (partitions, heaps, areas)


def _py_nbytes(obj: object, depth: int = 0) -> int:
    """Approximate, deterministic size of a plan's Python objects (no sys.getsizeof: same on every rank)."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return _INT_BYTES
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes) + 112
    if depth > 12:
        return _SEQ_BYTES
    if isinstance(obj, tuple | list):
        if obj and all(type(x) is int for x in obj[:4]) and type(obj[-1]) is int:
            return _SEQ_BYTES + len(obj) * _INT_BYTES  # flat int tuple: skip the walk
        return _SEQ_BYTES + sum(8 + _py_nbytes(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return 232 + sum(_py_nbytes(k, depth + 1) + _py_nbytes(v, depth + 1) for k, v in obj.items())
    if dataclasses.is_dataclass(obj):
        return _SEQ_BYTES + sum(
            8 + _py_nbytes(getattr(obj, f.name), depth + 1) for f in dataclasses.fields(obj)
        )
    slots = getattr(type(obj), "__slots__", None)
    if slots:
        return _SEQ_BYTES + sum(8 + _py_nbytes(getattr(obj, s, None), depth + 1) for s in slots)
    values = getattr(obj, "__dict__", None)
    if values is not None:
        return _py_nbytes(dict(values), depth + 1)
    return _SEQ_BYTES


def runtime_nbytes(layout: object, plan: object) -> int:
    """Estimated bytes one cache entry costs on this rank: host plan + one device's tensors."""
    padded = int(layout.padded_seqlen)
    shard = int(layout.shard_seqlen)
    host = _py_nbytes(plan) + int(layout.permutation.nbytes)
    # device: local ids [shard] + unpermutation [padded] (int64) + per stage the GroupCast/GroupReduce index
    # tensors of the busiest rank (max over ranks: the same number on every rank)
    remote = 0
    if plan is not None:
        remote = max(sum(int(s.num_remote_tokens) for s in r.stages) for r in plan.ranks)
    device = 8 * (padded + shard) + 2 * 8 * 2 * (remote + shard)
    return host + device


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
