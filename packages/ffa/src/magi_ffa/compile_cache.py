"""Compiled kernels that persist across processes: the vendors' on-disk caches, turned on by default.

FlashAttention-4 and cuDNN's flex_attention compile their CuTe DSL kernels on first use (seconds per
variant) and can keep them on disk, but only when a variable says so, and they read it once, when their
module is imported. ``enable_vendor_cache`` (called by ``magi_ffa_fa4`` and ``magi_ffa_cudnn`` when they are
imported, before any vendor import) sets those variables unless the user set them, so a user's own
setting always wins:

========  ==========================================  ===========================================
vendor    on / off                                    directory
========  ==========================================  ===========================================
fa4       ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED``  ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``
cudnn     ``FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED``   ``FLEX_ATTENTION_CUTE_DSL_CACHE_DIR``
========  ==========================================  ===========================================

The directory is ``<root>/<vendor>/<package version>-<hash of the package's sources>``, with ``<root>`` from
``magi_ffa.env.cache_dir()`` (``MAGI_ATTENTION_CACHE_DIR``, else ``$XDG_CACHE_HOME/magi_attention``, else
``~/.cache/magi_attention``). The vendors key their entries by their own sources (and the CuTe DSL version)
only; our packages patch their mask code (``magi_ffa_fa4._fa4_mask``) and hand them mask functions, so our
sources' hash is part of the directory and a changed patch never loads a stale kernel.
``MAGI_ATTENTION_COMPILE_CACHE=0`` leaves the vendors' defaults (no disk cache).

Sharing one directory between the ranks of a node is safe: both vendors take a file lock per entry (shared
to read, exclusive to write), and FA4 writes to a temporary name and renames it into place. cuDNN 1.32
writes its entry in place under the exclusive lock, so a process killed while writing can leave a truncated
entry that later loads fail on: delete the ``cudnn`` sub-directory then.

Triton (the ``triton`` backend) caches on disk by default (``TRITON_CACHE_DIR``, else ``~/.triton/cache``;
written atomically), so nothing is set for it; ``cache_report`` lists it beside the others.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from . import env

__all__ = ["VENDORS", "CacheState", "cache_report", "dir_size", "enable_vendor_cache", "source_tag"]


@dataclass(frozen=True, slots=True)
class _Vendor:
    enabled_var: str
    dir_var: str
    module: str
    """The vendor module that reads the variables when it is imported (too late after that)."""


VENDORS: dict[str, _Vendor] = {
    "fa4": _Vendor(
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
        "flash_attn.cute.cache_utils",
    ),
    "cudnn": _Vendor(
        "FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED",
        "FLEX_ATTENTION_CUTE_DSL_CACHE_DIR",
        "cudnn.flex_attention.runtime.compile_cache",
    ),
}
"""The vendors whose caches are turned on, by backend name, and the variables they read."""


@dataclass(frozen=True, slots=True)
class CacheState:
    """One compiled-kernel cache as this process uses it."""

    name: str
    """``fa4``, ``cudnn`` or ``triton``."""
    enabled: bool
    """Whether kernels compiled in this process are written to / read from ``directory``."""
    directory: str
    how: str
    """Why: ``"magi default"`` (set by us), ``"user setting"``, the reason it is off, ..."""


_STATE: dict[str, CacheState] = {}


def source_tag(package_dir: str | os.PathLike, version: str) -> str:
    """``"<version>-<12 hex digits>"``: the SHA-256 of every ``.py`` file of ``package_dir`` (names and
    contents, sorted), so any change of our kernels' sources gives another cache directory."""
    h = hashlib.sha256()
    root = Path(package_dir)
    for src in sorted(root.rglob("*.py")):
        h.update(src.relative_to(root).as_posix().encode())
        h.update(src.read_bytes())
    return f"{version}-{h.hexdigest()[:12]}"


def enable_vendor_cache(vendor: str, package_dir: str | os.PathLike, version: str) -> CacheState:
    """Turn on ``vendor``'s on-disk cache (``"fa4"`` or ``"cudnn"``) unless the user decided otherwise; call
    it before the vendor module is imported (see the module docstring). Returns what was decided."""
    if vendor not in VENDORS:
        raise ValueError(f"vendor must be one of {sorted(VENDORS)}, got {vendor!r}")
    spec = VENDORS[vendor]
    user_enabled = env.vendor_setting(spec.enabled_var)
    user_dir = env.vendor_setting(spec.dir_var)
    if user_enabled is not None and user_enabled.strip() != "":
        on = user_enabled.strip() == "1"  # the vendors' own rule: exactly "1" turns the cache on
        state = CacheState(vendor, on, user_dir or "", f"user setting {spec.enabled_var}={user_enabled}")
    elif not env.compile_cache():
        state = CacheState(vendor, False, "", "off: MAGI_ATTENTION_COMPILE_CACHE=0")
    elif spec.module in sys.modules:
        state = CacheState(vendor, False, "", f"off: {spec.module} was imported before magi_ffa_{vendor}")
    else:
        root, _ = env.cache_dir()
        directory = user_dir or os.path.join(root, vendor, source_tag(package_dir, version))
        env.set_vendor_setting(spec.dir_var, directory)  # == the user's directory when they gave one
        env.set_vendor_setting(spec.enabled_var, "1")
        state = CacheState(vendor, True, directory, "user directory" if user_dir else "magi default")
    _STATE[vendor] = state
    return state


def _triton_state() -> CacheState:
    user = env.vendor_setting("TRITON_CACHE_DIR")
    if user:
        return CacheState("triton", True, user, "user setting TRITON_CACHE_DIR")
    home = env.vendor_setting("TRITON_HOME") or os.path.expanduser("~")
    return CacheState("triton", True, os.path.join(home, ".triton", "cache"), "Triton's default")


def cache_report() -> list[CacheState]:
    """Every compiled-kernel cache: FA4's and cuDNN's as decided when their packages were imported (or,
    when not imported yet, where they would go), and Triton's."""
    out = []
    root, _ = env.cache_dir()
    for name in VENDORS:
        state = _STATE.get(name)
        if state is None:
            state = CacheState(name, False, os.path.join(root, name), "package not imported")
        out.append(state)
    out.append(_triton_state())
    return out


def dir_size(path: str | os.PathLike) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f), follow_symlinks=False).st_size
            except OSError:  # removed meanwhile (another rank's temporary file)
                pass
    return total
