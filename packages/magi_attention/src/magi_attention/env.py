"""Every environment variable magi_attention reads, in one place (read on each call, so tests can set them).

- ``MAGI_ATTENTION_SANITY_CHECK``: 1 = ranks exchange one flag before collectives so bad input on any rank
  makes every rank raise (a host sync per call; off by default).
- ``MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE``: plans kept per cp group (LRU, default 1000).
- ``MAGI_ATTENTION_KERNEL_BACKEND``: overrides ``DistAttnConfig(kernel_backend="auto")``; one of ``auto``,
  ``fa4``, ``triton`` (or MagiAttention's ``ffa``), ``torch`` (or ``sdpa``).
- ``MAGI_ATTENTION_COST_PROFILE``: overlap cost-model profile (a name of ``magi_solver.PROFILES`` or a JSON
  file) when ``OverlapConfig.cost_profile`` is None.
- ``TRITON_INTERPRET`` (Triton's): 1 lets the Triton backend run on CPU tensors (tests).
"""

from __future__ import annotations

import os

from .config import KernelBackend

_BACKEND_ALIASES = {"ffa": KernelBackend.TRITON, "sdpa": KernelBackend.TORCH}


def sanity_check_enabled() -> bool:
    return os.environ.get("MAGI_ATTENTION_SANITY_CHECK", "0") not in ("", "0", "false", "False")


def runtime_dict_size() -> int:
    return int(os.environ.get("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", "1000"))


def kernel_backend_override() -> KernelBackend | None:
    """The backend MAGI_ATTENTION_KERNEL_BACKEND asks for, None when unset/empty. ValueError when invalid."""
    raw = os.environ.get("MAGI_ATTENTION_KERNEL_BACKEND", "").strip().lower()
    if not raw:
        return None
    if raw in _BACKEND_ALIASES:
        return _BACKEND_ALIASES[raw]
    try:
        return KernelBackend(raw)
    except ValueError:
        valid = ", ".join([b.value for b in KernelBackend] + list(_BACKEND_ALIASES))
        raise ValueError(f"MAGI_ATTENTION_KERNEL_BACKEND={raw!r} is not valid; use one of: {valid}") from None


def triton_interpret() -> bool:
    """Triton's own TRITON_INTERPRET: its kernels then run on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cost_profile_override() -> str | None:
    raw = os.environ.get("MAGI_ATTENTION_COST_PROFILE", "").strip()
    return raw or None
