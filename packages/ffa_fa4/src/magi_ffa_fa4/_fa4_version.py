"""The flash-attn-4 release this package runs on, read once from the installed distribution.

This package calls FA4's private ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``, mirrors
their compiled-kernel keys (``_launch_meta.compile_key``) and replaces ``flash_attn.cute.mask.AttentionMask.
apply_mask`` for its interval mask (``_fa4_mask``). None of that is a stable API, so every release it
supports is listed here, each read in full; the package requirement pins :data:`PINNED`.

What differs between the supported releases, for this package:

- ``4.0.0b36`` (the pin): the compile keys list the forward's tile, stage and scheduler choices one by one,
  among them ``is_static_persistent`` (a varlen call whose packed longest query fits one tile).
- ``4.0.0b40``: ``_flash_attn_fwd`` drops ``num_threads``, takes ``scales`` and a keyword-only ``config``;
  ``_flash_attn_bwd`` takes a keyword-only ``config`` (its tile / stage / layout arguments are ignored). Both
  build their compile key from the selected ``FwdConfig`` / ``BwdConfig``. On Hopper those configs follow
  from the problem's configuration and the window kind only; on Blackwell the GQA backward packs query heads
  by a heuristic that reads the sequence lengths, and a varlen forward whose entries are shorter than its
  query tiles takes a dynamic scheduler (never ours: ``varlen.MIN_MEAN_ROWS``). The SM90 backward bounds ragged K/V loads and its register split is a
  config field. The keywords this package passes and ``AttentionMask.apply_mask``'s signature, with every
  helper the interval mask uses, are the same in both.
"""

from __future__ import annotations

import functools
from importlib import metadata

DISTRIBUTION = "flash-attn-4"
PINNED = "4.0.0b36"
"""The release the package requirement names (moved only after a GPU validation)."""
SUPPORTED = ("4.0.0b36", "4.0.0b40")
"""Releases whose private calls, compile keys and mask code this package was written against."""
CONFIG_KEYED = frozenset({"4.0.0b40"})
"""Releases that build compile keys from a resolved ``FwdConfig`` / ``BwdConfig``."""


@functools.cache
def installed() -> str | None:
    """The installed flash-attn-4 version (the first distribution on ``sys.path``, as Python imports it), or
    None. Read once per process."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def resolve(version: str | None = None) -> str:
    """``version`` if given, else the installed release, else :data:`PINNED` (no flash-attn-4 here: the
    release the package requirement would install).

    Raises:
        ValueError: the release is not one of :data:`SUPPORTED`.
    """
    if version is None:
        version = installed() or PINNED
    if version not in SUPPORTED:
        raise ValueError(
            f"`fa4_version` must be one of {', '.join(SUPPORTED)} (the flash-attn-4 releases magi_ffa_fa4 "
            f"supports), got {version!r}"
        )
    return version


def mask_patch_supported(version: str | None) -> bool:
    """Whether ``_fa4_mask`` may replace ``AttentionMask.apply_mask`` in this release (one it was read
    against); any other release keeps FA4's own mask code (the per-element ``mask_mod``)."""
    return version in SUPPORTED
