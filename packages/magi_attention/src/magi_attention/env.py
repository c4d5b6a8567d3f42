"""Every environment variable magi_attention reads, in one place (read on each call, so tests can set them).

- ``MAGI_ATTENTION_SANITY_CHECK``: 1 = key builds that hit the runtime cache agree across ranks too (every
  public collective call agrees always; off by default).
- ``MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE``: plans kept per cp group (LRU, default 1000).
- ``MAGI_ATTENTION_RUNTIME_CACHE_MB``: estimated memory of the plans kept per cp group (LRU, default 1024).
  Every rank must see the same values of both (evictions must match across ranks).
- ``MAGI_ATTENTION_KERNEL_BACKEND``: overrides ``DistAttnConfig(kernel_backend="auto")``; one of ``auto``,
  ``fa4``, ``cudnn``, ``triton`` (or MagiAttention's ``ffa``), ``torch`` (or ``sdpa``).
- ``MAGI_ATTENTION_COST_PROFILE``: overlap cost-model profile (a name of ``magi_solver.PROFILES`` or a JSON
  file) when ``OverlapConfig.cost_profile`` is None.
- ``MAGI_ATTENTION_DETERMINISTIC_MODE``: the default of ``DistAttnConfig.deterministic`` (read when a config
  is built): true makes every kernel call and GroupReduce of ``calc_attn`` bitwise reproducible.
- ``MAGI_ATTENTION_HIERARCHICAL_COMM``: on a 2-D (inter, intra) mesh, run GroupCast / GroupReduce
  hierarchically (default true); false runs the flat all-to-all-v over the same ranks.
- ``MAGI_ATTENTION_NATIVE_GRPCOLL``: true selects the native group-collective implementation (symmetric
  memory inside one node) when ``DistAttnConfig.grpcoll_config.native`` is None (default false).
- ``MAGI_ATTENTION_MASK_MOD_COMPILE``: on a GPU, ``infer_attn_mask_from_mask_mod`` evaluates the mask
  through one ``torch.compile``-d kernel per tile first (default true); false keeps the eager pass only.
- ``TRITON_INTERPRET`` (Triton's): 1 lets the Triton backend run on CPU tensors (tests).

Booleans accept 0 / 1 / true / false in any case (unset or empty = the default) and raise ValueError naming
the variable for anything else; valued variables are checked against their allowed values. ``docs/flags.md``
lists every package's variables.
"""

from __future__ import annotations

import os

from magi_mask.flags import parse_bool, parse_positive_int

# magi_ffa's enum (what config.py re-exports): config.py reads this module when a config is built.
from magi_ffa import KernelBackend

_BACKEND_ALIASES = {"ffa": KernelBackend.TRITON, "sdpa": KernelBackend.TORCH}


def _flag(name: str, default: bool) -> bool:
    return parse_bool(name, os.environ.get(name), default)


def sanity_check_enabled() -> bool:
    """MAGI_ATTENTION_SANITY_CHECK (boolean, default false): key builds that hit the runtime cache take part in
    the key agreement too (a cache hit communicates nothing by default), so a key build that fails on one
    rank is heard by the others even when they hit the cache. Every public collective call agrees always."""
    return _flag("MAGI_ATTENTION_SANITY_CHECK", False)


def deterministic_mode() -> bool:
    """MAGI_ATTENTION_DETERMINISTIC_MODE (boolean, default false): the default of
    `DistAttnConfig.deterministic` (None resolves to this or `torch.are_deterministic_algorithms_enabled()`).
    Read when a config is built; the runtime then reads the key's config, never this variable per call."""
    return _flag("MAGI_ATTENTION_DETERMINISTIC_MODE", False)


def hierarchical_comm() -> bool:
    """MAGI_ATTENTION_HIERARCHICAL_COMM (boolean, default true): on a 2-D (inter, intra) DeviceMesh the
    GroupCast / GroupReduce plans are hierarchical (a piece crosses the inter-node link once per node);
    false makes them flat all-to-all-v over the same ranks. Flat groups are unaffected. Read when a key is
    built (`_runtime.collective_choice.choose_collective`)."""
    return _flag("MAGI_ATTENTION_HIERARCHICAL_COMM", True)


def native_grpcoll() -> bool:
    """MAGI_ATTENTION_NATIVE_GRPCOLL (boolean, default false): use the native group-collective
    implementation (`GroupCollectiveImpl.NATIVE`: symmetric memory inside one node, CUDA + NCCL +
    `magi-group-collective[native]`) instead of a2av / hierarchical, unless `GrpCollConfig.native` says
    otherwise. Where native cannot run, the first call of a key raises NativeUnavailableError on every rank."""
    return _flag("MAGI_ATTENTION_NATIVE_GRPCOLL", False)


def mask_mod_compile() -> bool:
    """MAGI_ATTENTION_MASK_MOD_COMPILE (boolean, default true): on a GPU, `infer_attn_mask_from_mask_mod`
    first evaluates large masks with `torch.compile` (mask, b/h check and per-row run statistics fused,
    the mask never in memory); false evaluates every tile eagerly. The CPU always evaluates eagerly. Read
    on each call."""
    return _flag("MAGI_ATTENTION_MASK_MOD_COMPILE", True)


def runtime_dict_size() -> int:
    """Plans kept per cp group (LRU); ValueError naming the variable for anything but an int >= 1."""
    return _positive_int_env("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", 1000)


DEFAULT_RUNTIME_CACHE_MB = 1024


def runtime_cache_bytes() -> int:
    """Estimated host + device bytes of cached plans kept per cp group (MAGI_ATTENTION_RUNTIME_CACHE_MB,
    default 1024 MiB); the LRU evicts past either bound."""
    return _positive_int_env("MAGI_ATTENTION_RUNTIME_CACHE_MB", DEFAULT_RUNTIME_CACHE_MB) << 20


def _positive_int_env(name: str, default: int) -> int:
    return parse_positive_int(name, os.environ.get(name), default)


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
    """Triton's own TRITON_INTERPRET (boolean, default false): its kernels then run on CPU tensors (tests)."""
    return _flag("TRITON_INTERPRET", False)


def cost_profile_override() -> str | None:
    """MAGI_ATTENTION_COST_PROFILE: the overlap cost model's profile (a name of `magi_solver.PROFILES` or a
    JSON file path) when `OverlapConfig.cost_profile` is None; unset = the profile of rank 0's GPU kind."""
    raw = os.environ.get("MAGI_ATTENTION_COST_PROFILE", "").strip()
    return raw or None


def child_process_env(**overrides: str) -> dict[str, str]:
    """This process's environment with `overrides`, for a child process (tests launching ranks)."""
    return {**os.environ, **overrides}


_REPORTED_PREFIXES = (
    "MAGI_",
    "FLASH_ATTENTION_CUTE_DSL_",
    "FLEX_ATTENTION_CUTE_DSL_",
    "TRITON_",
    "CUDA_VISIBLE",
)


def variables_in_effect() -> dict[str, str]:
    """Every set variable that changes what this library does (``MAGI_*``, the vendors' compile-cache
    variables, ``TRITON_*``, ``CUDA_VISIBLE_DEVICES``), sorted by name, for ``python -m magi_attention.info``."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_REPORTED_PREFIXES)}
