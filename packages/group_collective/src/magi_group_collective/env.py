"""Every environment variable magi_group_collective reads, in one place: one function per variable (the
callers cache the result: each is read once per process, see ``_config`` / ``_ops``, except ``impl``, read
when a plan is built); never written.

Booleans accept ``0`` / ``1`` / ``true`` / ``false`` in any case (unset or empty = the default) and raise
``ValueError`` naming the variable for anything else; valued variables are checked against their allowed
values. ``docs/flags.md`` lists every package's variables.
"""

from __future__ import annotations

import os

from magi_mask.flags import parse_bool, parse_positive_int

__all__ = ["debug", "impl", "kernels", "native_buffer_mb"]


def _flag(name: str, default: bool) -> bool:
    return parse_bool(name, os.environ.get(name), default)


def _choice(name: str, allowed: tuple[str, ...]) -> str | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if raw.lower() not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {raw!r}")
    return raw.lower()


def impl() -> str | None:
    """``MAGI_GROUP_COLLECTIVE_IMPL``: ``a2av``, ``hierarchical`` or ``native`` for plans built without an
    explicit ``impl``. Default (unset): ``hierarchical`` on a 2-D DeviceMesh, else ``a2av``. ``native``
    (symmetric memory, one node, CUDA + NCCL + cuda-bindings) raises NativeUnavailableError where it
    cannot run."""
    return _choice("MAGI_GROUP_COLLECTIVE_IMPL", ("a2av", "hierarchical", "native"))


def debug() -> bool:
    """``MAGI_GROUP_COLLECTIVE_DEBUG`` (boolean, default false): cross-check the tables of every rank at each
    plan construction (one all-gather of the tables; raises on inconsistency)."""
    return _flag("MAGI_GROUP_COLLECTIVE_DEBUG", False)


def kernels() -> str | None:
    """``MAGI_GROUP_COLLECTIVE_KERNELS``: ``torch`` or ``triton`` forces the row gather / scatter / reduce
    kernels around the all-to-all (``triton`` on CPU needs ``TRITON_INTERPRET=1``). Default: Triton on CUDA,
    torch elsewhere."""
    return _choice("MAGI_GROUP_COLLECTIVE_KERNELS", ("torch", "triton"))


def native_buffer_mb() -> int:
    """``MAGI_GROUP_COLLECTIVE_NATIVE_BUFFER_MB`` (int >= 4, default 64): initial size in MiB of the symmetric
    buffer the native implementation maps on every rank of a group (it doubles when a call needs more; every
    rank must see the same value)."""
    name = "MAGI_GROUP_COLLECTIVE_NATIVE_BUFFER_MB"
    return parse_positive_int(name, os.environ.get(name), 64, minimum=4)
