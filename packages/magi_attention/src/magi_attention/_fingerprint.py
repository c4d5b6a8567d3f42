"""Key creation as a collective: every rank checks that the others built the same key, before any plan.

A key is a value every rank computes on its own; nothing forces two ranks to compute the same one. A mask,
a size, a head count or a config that differs across ranks would give plans whose GroupCast tables do not
match (stale rows, or gloo aborting the process). So when a key is built for the first time (a cache miss),
the ranks all-gather one small int64 row each: a status flag and one 63-bit hash per part of the key (mask,
sizes, heads, config, group, dispatch key, pad size). Different hashes raise on every rank, naming the
part and the ranks; a rank whose key build failed sends the failed flag instead, so the others raise too
rather than wait for it in the next collective. Cache hits communicate nothing (in sanity mode,
MAGI_ATTENTION_SANITY_CHECK=1, every key build exchanges, hits included, so no rank can be left waiting).

Rule that follows: every rank of a cp group must build its keys in the same order (as for any collective).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from magi_group_collective import GroupCollectiveImpl
from magi_group_collective import env as grpcoll_env

from ._cache_budget import check_plan_fits
from ._layout import choose_chunk_size
from ._runtime import collective_impl
from .env import sanity_check_enabled
from .key import CpGroup, DistAttnRuntimeKey

PARTS = (
    "mask (q_ranges / k_ranges / attn_mask_type)",
    "sizes (total_seqlen_q / total_seqlen_k)",
    "heads (num_heads_q / num_heads_kv / head_dim)",
    "dist_attn_config",
    "cp group",
    "key_for_dispatch",
    "pad_size",
    "group-collective implementation (MAGI_ATTENTION_NATIVE_GRPCOLL, MAGI_ATTENTION_HIERARCHICAL_COMM, "
    "MAGI_GROUP_COLLECTIVE_IMPL, MAGI_GROUP_COLLECTIVE_NATIVE_BUFFER_MB)",
)
_OK, _FAILED = 0, 1


def _h(value: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


def key_fingerprint(key: DistAttnRuntimeKey, pad_size: object = None) -> list[int]:
    """One 63-bit hash per entry of `PARTS` (deterministic across processes: no Python `hash`)."""
    group = key.cp_group
    dispatch = None if key.dispatch_key is None else key_fingerprint(key.dispatch_key)
    return [
        _h((key.q_ranges, key.k_ranges, key.attn_mask_type)),
        _h((key.total_seqlen_q, key.total_seqlen_k)),
        _h((key.num_heads_q, key.num_heads_kv, key.head_dim)),
        _h(key.config),
        _h((group.name, group.ranks, group.mesh_shape)),
        _h(dispatch),
        _h(pad_size),
        _h(_collective_choice(key)),
    ]


def _collective_choice(key: DistAttnRuntimeKey) -> tuple[object, ...]:
    """What the environment adds to the config in choosing the group collectives: ranks that chose
    differently would enter different collectives (native buffer set-up against an all-to-all) and hang."""
    impl = collective_impl(key.cp_group.mesh is not None, key.config.grpcoll_config.native)
    fallback = grpcoll_env.impl() if impl is None else None  # magi_group_collective decides then
    native = impl is GroupCollectiveImpl.NATIVE or fallback == "native"
    return (impl, fallback, grpcoll_env.native_buffer_mb() if native else None)


def _flag_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(cp_group: CpGroup, row: list[int]) -> list[list[int]]:
    group = cp_group.group
    mine = torch.tensor(row, dtype=torch.int64, device=_flag_device(group))
    parts = [torch.empty_like(mine) for _ in range(cp_group.size)]
    try:
        dist.all_gather(parts, mine, group=group)
    except RuntimeError as exc:
        raise type(exc)(
            f"rank {dist.get_rank(group)} of cp group {cp_group.name!r}: the key-agreement all-gather of "
            f"magi_attn_flex_key failed (a rank did not build the key, or built keys in another order; "
            f"the process group's timeout bounds this wait): {exc}"
        ) from exc
    return [p.tolist() for p in parts]


def _collective(cp_group: CpGroup) -> bool:
    return cp_group.group is not None and cp_group.size > 1


class _State(threading.local):
    depth = 0
    settled = False  # this key build has exchanged, or knows the others will not (a cache hit)


_STATE = _State()


def agree_on_key(key: DistAttnRuntimeKey, is_cached: bool, pad_size: object = None) -> None:
    """Check the key against every other rank's before it is planned (one all-gather, cache misses only,
    every build in sanity mode). Raises ValueError on every rank when the ranks disagree or one failed."""
    cp_group = key.cp_group
    sanity = sanity_check_enabled()
    if not _collective(cp_group) or (is_cached and not sanity):
        _STATE.settled = True
        return
    row = [_OK, *key_fingerprint(key, pad_size)]
    error: BaseException | None = None
    if not is_cached:
        try:  # a plan that cannot fit fails here, before the exchange, so the others hear of it
            root = key.root_key
            chunk = choose_chunk_size(
                root.total_seqlen_q, cp_group.size, root.config.dispatch_config.chunk_size
            )
            check_plan_fits(root.total_seqlen_q, cp_group.size, chunk)
            if root.total_seqlen_k != root.total_seqlen_q:
                check_plan_fits(root.total_seqlen_k, cp_group.size, chunk, "total_seqlen_k")
        except (MemoryError, ValueError) as exc:
            error = exc
            row[0] = _FAILED
    rows = _exchange(cp_group, row)
    _STATE.settled = True
    if error is not None:
        raise error
    _raise_on_disagreement(cp_group, rows, dist.get_rank(cp_group.group))


def _raise_on_disagreement(cp_group: CpGroup, rows: list[list[int]], me: int) -> None:
    failed = [r for r, row in enumerate(rows) if row[0] != _OK]
    if failed:
        raise ValueError(
            f"rank(s) {failed} of cp group {cp_group.name!r} failed to build this key (see their error); "
            f"rank {me} stops too instead of waiting for them in a collective"
        )
    reference = rows[0]
    problems = []
    for i, part in enumerate(PARTS):
        groups: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            groups.setdefault(row[1 + i], []).append(r)
        if len(groups) > 1:
            sides = " vs ".join(f"ranks {ranks}" for ranks in groups.values())
            problems.append(f"{part} differs: {sides}")
    if problems or any(row != reference for row in rows):
        raise ValueError(
            f"the ranks of cp group {cp_group.name!r} built different keys (every rank must pass the same mask, "
            "sizes, heads and config, and build its keys in the same order): " + "; ".join(problems)
        )


def _report_failure(cp_group: CpGroup) -> None:
    """This rank's key build failed before it could agree: tell the others (they raise too)."""
    try:
        _exchange(cp_group, [_FAILED] + [0] * len(PARTS))
    except Exception:
        pass


def collective_key_build(group_of: Callable[[inspect.BoundArguments], CpGroup | None]) -> Callable:
    """Decorate a public key builder: an error raised before this rank took part in the key agreement is
    reported to the other ranks (one all-gather with the failed flag), then re-raised. Nested builders
    (the varlen ones call the flex ones) report once, from the outermost call."""

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _STATE.depth:
                return fn(*args, **kwargs)
            _STATE.depth, _STATE.settled = 1, False
            try:
                return fn(*args, **kwargs)
            except Exception:
                if not _STATE.settled:
                    cp_group = _group_or_none(signature, group_of, args, kwargs)
                    if cp_group is not None and _collective(cp_group):
                        _report_failure(cp_group)
                raise
            finally:
                _STATE.depth, _STATE.settled = 0, False

        return wrapper

    return decorate


def _group_or_none(signature, group_of, args, kwargs) -> CpGroup | None:
    try:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return group_of(bound)
    except Exception:
        return None
