"""Key creation as a collective: every rank builds a new key, then checks it against the others' in one
exchange, before any data moves.

A key is a value every rank computes on its own; nothing forces two ranks to compute the same one. A mask,
a size, a head count or a config that differs across ranks would give plans whose GroupCast tables do not
match (stale rows, or gloo aborting the process). So when a key is built for the first time (a cache miss),
each rank plans it locally (`key_route.build_key`), then the ranks all-gather one small int64 row each: a
status flag, one 63-bit hash per part of the key (mask, sizes, heads, config, deterministic mode, group,
dispatch key, pad size), and the rank's word about kernels (a digest of what it can run, and whether the
chosen kernel libraries imported: `key_route.KeyWord`), through the host-side status agreement every
public collective call uses (`magi_group_collective.agreement`: so a key build on one rank and a `dispatch`
on another meet and are told so). Different hashes raise on every rank, naming the part and the ranks; a
rank whose build failed sends the failed flag instead, so the others raise too rather than wait for it in
the next collective. Cache hits communicate nothing (in sanity mode, MAGI_ATTENTION_SANITY_CHECK=1, every
key build exchanges, hits included, so no rank can be left waiting).

Rule that follows: every rank of a cp group must build its keys in the same order (as for any collective).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

from magi_group_collective.agreement import ExchangeError, agree

from ..._layout import choose_chunk_size
from ...env import sanity_check_enabled
from ...key import CpGroup, DistAttnRuntimeKey
from ..cache import RUNTIME_CACHE
from ..cache_budget import check_plan_fits
from ..key_route import build_key, settle
from ._comm_errors import CommError, where

PARTS = (
    "mask (q_ranges / k_ranges / attn_mask_type)",
    "sizes (total_seqlen_q / total_seqlen_k)",
    "heads (num_heads_q / num_heads_kv / head_dim)",
    "dist_attn_config",
    "deterministic (DistAttnConfig.deterministic; None follows MAGI_ATTENTION_DETERMINISTIC_MODE and "
    "torch.use_deterministic_algorithms)",
    "cp group",
    "key_for_dispatch",
    "pad_size",
    "group-collective implementation (MAGI_ATTENTION_NATIVE_GRPCOLL, MAGI_ATTENTION_HIERARCHICAL_COMM, "
    "MAGI_GROUP_COLLECTIVE_IMPL, MAGI_GROUP_COLLECTIVE_NATIVE_BUFFER_MB)",
)


def _h(value: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


def key_parts(key: DistAttnRuntimeKey, pad_size: object = None) -> list[object]:
    """The value of each entry of `PARTS` (compared across ranks by a deterministic hash of their repr)."""
    group = key.cp_group
    dispatch = None if key.dispatch_key is None else key_fingerprint(key.dispatch_key)
    return [
        (key.q_ranges, key.k_ranges, key.attn_mask_type),
        (key.total_seqlen_q, key.total_seqlen_k),
        (key.num_heads_q, key.num_heads_kv, key.head_dim),
        # the deterministic flag is its own part, so a rank set differently is told that and nothing else
        dataclasses.replace(key.config, deterministic=False),
        key.config.deterministic,
        (group.name, group.ranks, group.mesh_shape),
        dispatch,
        pad_size,
        key.collective,
    ]


def key_fingerprint(key: DistAttnRuntimeKey, pad_size: object = None) -> list[int]:
    """One 63-bit hash per entry of `PARTS` (deterministic across processes: no Python `hash`)."""
    return [_h(part) for part in key_parts(key, pad_size)]


KEY_CALL = "the key build (magi_attn_*_key / make_*_key_for_new_mask_after_dispatch)"


def _agree(
    cp_group: CpGroup, error: BaseException | None, parts: list[object], word: Sequence[int] = ()
) -> list[list[int]]:
    """The key's status agreement (raises `error` here, AgreementError on the others, CommError when the
    exchange itself fails); every rank's `word` (`key_route.KeyWord`) in rank order."""
    same = dict(zip(PARTS, parts))
    try:
        return agree(cp_group.group, KEY_CALL, error=error, same=same, extra=word)
    except ExchangeError as exc:
        raise CommError(
            f"{where(cp_group)}: the status agreement of {KEY_CALL} failed: {exc.detail}\n(a rank did not "
            "build the key, or built keys in another order; the process group's timeout bounds this wait)"
        ) from exc


def _collective(cp_group: CpGroup) -> bool:
    return cp_group.group is not None and cp_group.size > 1


class _State(threading.local):
    depth = 0
    settled = False  # this key build has exchanged, or knows the others will not (a cache hit)


_STATE = _State()


def agree_on_key(key: DistAttnRuntimeKey, is_cached: bool, pad_size: object = None) -> None:
    """Build a new key on every rank together: each rank plans it locally (`key_route.build_key`), then the
    ranks check it against each other's in one all-gather (its parts, the status of the build, and what each
    can run and imported: `key_route.KeyWord`), then keep it cached (`RUNTIME_CACHE.admit`). Raises on
    every rank when the ranks disagree or one failed. Cache hits communicate nothing (but in sanity mode)."""
    cp_group = key.cp_group
    sanity = sanity_check_enabled()
    if not _collective(cp_group) or (is_cached and not sanity):
        _STATE.settled = True
        return
    parts = key_parts(key, pad_size)
    if is_cached or key in RUNTIME_CACHE:  # agreed again (sanity mode): built already
        _STATE.settled = True
        _agree(cp_group, None, parts)
        return
    error: BaseException | None = None
    layout = build = None
    try:  # a plan that cannot fit fails here, before the exchange, so the others hear of it
        root = key.root_key
        chunk = choose_chunk_size(root.total_seqlen_q, cp_group.size, root.config.dispatch_config.chunk_size)
        check_plan_fits(root.total_seqlen_q, cp_group.size, chunk)
        if root.total_seqlen_k != root.total_seqlen_q:
            check_plan_fits(root.total_seqlen_k, cp_group.size, chunk, "total_seqlen_k")
        layout = RUNTIME_CACHE.layout_of(key)
        build = build_key(key, layout)  # local: the key's steps, nothing exchanged
    except Exception as exc:  # any local failure is reported, so no rank is left waiting for this one
        error = exc
    _STATE.settled = True
    try:
        words = _agree(cp_group, error, parts, () if build is None else build.word)
        build = settle(key, layout, build, words)
    except BaseException:
        RUNTIME_CACHE.drop_unused_layout(key)
        raise
    RUNTIME_CACHE.admit(key, layout, build)


def _report_failure(cp_group: CpGroup, error: BaseException) -> None:
    """This rank's key build failed before it could agree: tell the others (they raise too); the caller
    re-raises `error` itself."""
    try:
        _agree(cp_group, error, [None] * len(PARTS))
    except BaseException:  # `error` re-raised by the agreement, or a failed exchange: the caller raises
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
            except Exception as exc:
                if not _STATE.settled:
                    cp_group = _group_or_none(signature, group_of, args, kwargs)
                    if cp_group is not None and _collective(cp_group):
                        _report_failure(cp_group, exc)
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
