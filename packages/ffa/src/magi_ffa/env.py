"""Every environment variable magi_ffa reads, in one place: one function per variable, read on each call
(tests and sweeps may change them between calls); the library never writes them, except
:func:`interpret_triton_without_cuda`, which test suites call from their ``conftest.py``.

Booleans accept ``0`` / ``1`` / ``true`` / ``false`` in any case (unset or empty = the default) and raise
``ValueError`` naming the variable for anything else; valued variables are checked against their allowed
values. The docs page ``docs/flags.md`` lists these with every other package's.
"""

from __future__ import annotations

import os

from magi_mask.flags import parse_bool

__all__ = [
    "backend",
    "interpret_triton_without_cuda",
    "parse_positive_int",
    "poison",
    "tiles",
    "triton_interpret",
]


def _flag(name: str, default: bool) -> bool:
    return parse_bool(name, os.environ.get(name), default)


def parse_positive_int(name: str, raw: str | None, default: int) -> int:
    """The value of a positive-int variable ``name`` from its raw text (unset or empty = ``default``);
    ValueError naming the variable otherwise. The parser of the kernel packages' env modules (they read their
    own variables and pass the text here)."""
    raw = (raw or "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r} is not valid: it must be a positive integer (default {default})")
    return value


def _choice(name: str, allowed: tuple[str, ...]) -> str | None:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return None
    if raw not in allowed:
        raise ValueError(f"{name}={raw!r} is not valid; use one of: {', '.join(allowed)}")
    return raw


def backend() -> str | None:
    """``MAGI_FFA_BACKEND``: ``triton`` or ``torch`` forces that kernel path for every call without an explicit
    ``backend=`` argument (an impossible request raises, never falls back). Default (unset): triton for CUDA
    fp16/bf16 with a power-of-two head_dim in [16, 256], torch otherwise."""
    return _choice("MAGI_FFA_BACKEND", ("triton", "torch"))


_TILE_FIELDS = {
    "fwd": "BLOCK_M,BLOCK_N,num_warps,num_stages[,tma]",
    "bwd": "BLOCK_M1,BLOCK_N1,BLOCK_M2,BLOCK_N2,num_warps,num_stages[,head_major[,split]]",
}


def tiles(kind: str) -> tuple[int, ...] | None:
    """``MAGI_FFA_TILES_FWD``: ``"BLOCK_M,BLOCK_N,num_warps,num_stages[,tma]"``; ``MAGI_FFA_TILES_BWD``:
    ``"BLOCK_M1,BLOCK_N1,BLOCK_M2,BLOCK_N2,num_warps,num_stages[,head_major[,split]]"`` (positive ints; tma,
    head_major and split 0 or 1; the blocks powers of two, at least 16) overriding the tile table of that Triton kernel
    (tuning sweeps, tests). Default: the table
    of ``_tiles.py`` for the GPU's architecture, the dtype and the head_dim."""
    fields = _TILE_FIELDS[kind]
    name = f"MAGI_FFA_TILES_{kind.upper()}"
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        vals = tuple(int(x) for x in raw.split(","))
    except ValueError:
        vals = ()
    nblocks = fields.count("BLOCK")
    n_required = fields.split("[")[0].count(",") + 1
    if (
        not n_required <= len(vals) <= fields.count(",") + 1
        or min(vals[:n_required]) < 1
        or any(x not in (0, 1) for x in vals[n_required:])
        or any(b < 16 or b & (b - 1) for b in vals[:nblocks])
    ):
        raise ValueError(f"{name}={raw!r} is not valid: use '{fields}' (blocks: powers of two >= 16)")
    return vals


def poison() -> bool:
    """``MAGI_FFA_POISON`` (boolean, default false): fill the Triton kernels' fresh outputs with NaN before
    launching, so that any element a kernel fails to write shows up (tests)."""
    return _flag("MAGI_FFA_POISON", False)


def triton_interpret() -> bool:
    """``TRITON_INTERPRET`` (Triton's own; boolean, default false): Triton runs kernels in its interpreter,
    so the triton backend accepts CPU tensors (tests, CI). Set it before Triton is imported."""
    return _flag("TRITON_INTERPRET", False)


def interpret_triton_without_cuda() -> bool:
    """Turn Triton's interpreter on (``TRITON_INTERPRET=1``) when the variable is unset and no CUDA device is
    present; returns whether the interpreter is on afterwards.

    The one rule of every test suite's ``conftest.py`` (re-exported by :mod:`magi_ffa.testing`), called before
    any Triton kernel module is imported. On a GPU machine the kernels then run compiled on the GPU's tensors
    (the interpreter would run them on the host, slowly, and not at all on bf16); an explicit
    ``TRITON_INTERPRET`` (CI sets 1) always wins.
    """
    import torch  # here, not at import: env stays importable without torch's start-up cost

    if not os.environ.get("TRITON_INTERPRET", "").strip() and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return triton_interpret()
