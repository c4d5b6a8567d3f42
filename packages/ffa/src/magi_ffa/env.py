"""Every environment variable magi_ffa reads, in one place: one function per variable, read on each call
(tests and sweeps may change them between calls); the library never writes them, except
:func:`interpret_triton_without_cuda`, which test suites call from their ``conftest.py``, and
:func:`set_vendor_setting`, with which ``magi_ffa.compile_cache`` turns the vendors' kernel caches on.

Booleans accept ``0`` / ``1`` / ``true`` / ``false`` in any case (unset or empty = the default) and raise
``ValueError`` naming the variable for anything else; valued variables are checked against their allowed
values. The docs page ``docs/flags.md`` lists these with every other package's.
"""

from __future__ import annotations

import os

# parse_positive_int: re-exported (the kernel packages' env modules imported it from here).
from magi_mask.flags import parse_bool, parse_positive_int

__all__ = [
    "backend",
    "cache_dir",
    "compile_cache",
    "interpret_triton_without_cuda",
    "mask_cache_bytes",
    "mask_cache_size",
    "parse_positive_int",
    "poison",
    "set_vendor_setting",
    "tiles",
    "triton_interpret",
    "vendor_setting",
]


def _flag(name: str, default: bool) -> bool:
    return parse_bool(name, os.environ.get(name), default)


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


def mask_cache_size() -> int:
    """``MAGI_FFA_MASK_CACHE`` (positive int, default 64): masks kept (LRU) by ``magi_ffa.mask_cache.MASKS``,
    each with its checked slices and every backend's launch data. Read once, when magi_ffa is imported."""
    return parse_positive_int("MAGI_FFA_MASK_CACHE", os.environ.get("MAGI_FFA_MASK_CACHE"), 64)


def mask_cache_bytes() -> int:
    """``MAGI_FFA_MASK_CACHE_MB`` (positive int, default 1024): MiB of tensors (host and device) the mask
    cache keeps over all its entries (least recently used masks go first). Read once, at import."""
    return parse_positive_int("MAGI_FFA_MASK_CACHE_MB", os.environ.get("MAGI_FFA_MASK_CACHE_MB"), 1024) << 20


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


def compile_cache() -> bool:
    """``MAGI_ATTENTION_COMPILE_CACHE`` (boolean, default true): when magi_ffa_fa4 / magi_ffa_cudnn are
    imported, turn on the vendors' on-disk caches of compiled kernels (FA4's and cuDNN flex_attention's), in
    ``cache_dir()``; false leaves the vendors' defaults (off). Read when those packages are imported."""
    return _flag("MAGI_ATTENTION_COMPILE_CACHE", True)


def cache_dir() -> tuple[str, str]:
    """``MAGI_ATTENTION_CACHE_DIR``: the root of magi-attention's compiled-kernel caches, and where it came
    from: ``(path, "MAGI_ATTENTION_CACHE_DIR")``, else ``($XDG_CACHE_HOME/magi_attention, "XDG_CACHE_HOME")``,
    else ``(~/.cache/magi_attention, "default")``. The path is expanded (``~``) but not created."""
    raw = os.environ.get("MAGI_ATTENTION_CACHE_DIR", "").strip()
    if raw:
        return os.path.abspath(os.path.expanduser(raw)), "MAGI_ATTENTION_CACHE_DIR"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg:
        return os.path.join(os.path.abspath(os.path.expanduser(xdg)), "magi_attention"), "XDG_CACHE_HOME"
    return os.path.join(os.path.expanduser("~"), ".cache", "magi_attention"), "default"


def vendor_setting(name: str) -> str | None:
    """The raw value of a vendor's own variable (``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, ``TRITON_CACHE_DIR``,
    ...), None when unset: ``magi_ffa.compile_cache`` leaves a user's own setting alone and reports it."""
    return os.environ.get(name)


def set_vendor_setting(name: str, value: str) -> None:
    """Set a vendor's own variable for this process and its children (the one place the library writes the
    environment: ``magi_ffa.compile_cache`` turns the vendors' kernel caches on before they are imported)."""
    os.environ[name] = value


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
