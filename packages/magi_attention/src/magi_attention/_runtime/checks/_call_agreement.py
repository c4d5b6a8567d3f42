"""The status agreement of every public collective call, so one rank's bad input never leaves the others
hanging (and a dtype that differs across ranks never reaches gloo, which aborts the process on it).

`dispatch`, `undispatch`, `dispatch_kv`, `undispatch_kv`, `roll`, `calc_attn` (forward and backward) and
`clear_cache` each validate their arguments locally, then call `agree_on_call`: the ranks of the cp group
exchange one small host-side row (`magi_group_collective.agreement`: ok / failed, the call, a hash of the
values every rank must pass alike, a flag saying whether this rank must build the plan's device tensors).
If any rank failed, every rank raises (the failing rank its own error, the others an `AgreementError`, a
ValueError, naming the call, the failing rank(s) and their reason); so do ranks in different calls, or with
different values (dtype, trailing shape, softmax_scale, ...). The exchange runs on the host (on the cp group
when it takes CPU tensors, else on a gloo group beside it): no device synchronisation.

`MAGI_ATTENTION_SANITY_CHECK=1` adds one more exchange: key builds that hit the cache (which communicate
nothing by default) agree too (`_key_agreement`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from magi_group_collective.agreement import ExchangeError, agree

from ...key import CpGroup
from ._comm_errors import CommError, where

T = TypeVar("T")


def tensor_values(x: object, name: str) -> dict[str, object]:
    """What every rank must pass alike for a token tensor: its dtype and its shape past dim 0 (a gather of
    rows whose byte sizes differ across ranks aborts gloo; rows of different layouts would mix silently)."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        return {}
    return {f"{name}.dtype": x.dtype, f"{name}.shape[1:]": tuple(x.shape[1:])}


def agree_on_call(
    cp_group: CpGroup,
    call: str,
    check: Callable[[], None],
    *,
    same: Callable[[], dict[str, object]] | None = None,
    extra: Callable[[], list[int]] | None = None,
) -> list[list[int]]:
    """Run `check` (the call's local validation), then agree with every rank of `cp_group` before any data
    moves: raises on every rank if any rank's check failed, if the ranks are in different calls, or if the
    values of `same` (called after a passing check) differ. Returns `extra()` of every rank.

    A cp group of one rank (or no process group) communicates nothing: `check` alone runs."""
    _, extras = agree_on_checked(
        cp_group,
        call,
        check,
        same=None if same is None else lambda _: same(),
        extra=None if extra is None else lambda _: extra(),
    )
    return extras


def agree_on_checked(
    cp_group: CpGroup,
    call: str,
    check: Callable[[], T],
    *,
    same: Callable[[T], dict[str, object]] | None = None,
    extra: Callable[[T], list[int]] | None = None,
) -> tuple[T, list[list[int]]]:
    """`agree_on_call` for a check that returns what it checked (e.g. the normalised arguments): `same` and
    `extra` take that value; returns it with `extra` of every rank."""
    if cp_group.group is None or cp_group.size == 1:
        checked = check()
        return checked, [list(extra(checked)) if extra is not None else []]
    error: Exception | None = None
    checked = None
    values: dict[str, object] = {}
    extras: list[int] = []
    try:
        checked = check()
        values = dict(same(checked)) if same is not None else {}
        extras = list(extra(checked)) if extra is not None else []
    except Exception as exc:  # any local failure is reported, so no rank is left waiting for this one
        error = exc
    try:
        return checked, agree(cp_group.group, call, error=error, same=values, extra=extras)
    except ExchangeError as exc:
        raise CommError(
            f"{where(cp_group)}: the status agreement of {call} failed: {exc.detail}\n(a peer rank failed, "
            "stopped or never reached this call; the wait is bounded by the process group's timeout)"
        ) from exc


def needs_device_meta(runtime: object, device: torch.device) -> list[int]:
    """This rank's extras for the agreement of a call that may build the plan's device tensors: 1 when it
    has not built them for `device` yet (that build is collective when a group collective needs every rank's
    tables), then the digest of every rank's GroupCast tables in its plan (`DistAttnRuntime.plan_digest`)."""
    return [int(device not in runtime._device_meta), runtime.plan_digest]


def build_device_meta_together(runtime: object, device: torch.device, flags: list[list[int]]) -> None:
    """After the agreement (`flags`: every rank's `needs_device_meta`): raise ValueError on every rank when
    the ranks planned different GroupCast tables for the key (checked before any table is used); if any rank
    must build the device tensors, every rank rebuilds them, so a build that communicates runs on every
    rank together (never on one rank alone, which would hang)."""
    check_plan_digests([f[1] for f in flags if len(f) > 1])
    if any(f and f[0] for f in flags):
        runtime._device_meta.pop(device, None)


def check_plan_digests(digests: list[int]) -> None:
    """Raise ValueError (on every rank: every rank compares the same list) when the ranks' `plan_digest`s
    differ: the ranks planned different GroupCast tables for the same key."""
    if len(set(digests)) > 1:
        sides: dict[int, list[int]] = {}
        for r, d in enumerate(digests):
            sides.setdefault(d, []).append(r)
        raise ValueError(
            "the ranks of the cp group planned different GroupCast tables for the same key (ranks "
            + " vs ".join(str(rs) for rs in sides.values())
            + "): every rank must run the same versions of magi_attention and magi_solver"
        )
