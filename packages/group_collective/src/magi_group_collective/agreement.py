"""Host-side status agreement of a collective call: before any data moves, every rank tells the others
"ok" or "failed", and what must agree across ranks (dtype, trailing shapes, scalars, table checksums).

Why: a collective only works when every rank of the group enters it with matching arguments. A rank that
rejects its own input raises at once, but the others would then block in the data collective until the
process group's timeout (30 minutes on gloo by default); a dtype or a routing table that differs across
ranks delivers stale rows or aborts the process inside gloo. So every public collective call of
magi-group-collective's functional API and of magi-attention first runs :func:`agree`:

1. each rank validates its arguments locally (without communicating);
2. the ranks all-gather one fixed-size int64 row each (:data:`ROW` values): a protocol marker, the status
   (ok / failed), a hash of the call's name, a hash of the values that must agree, and a few integers the
   caller checks itself (e.g. table checksums);
3. if every row agrees the call goes on. Otherwise (rare) every rank takes part in a second exchange of a
   short description per rank (the call, the local error, the values) and raises: the failing rank its own
   error, the others :class:`AgreementError` naming the call, the failing rank(s) and their reason, or the
   ranks that are in another call, or the value that differs and the ranks on each side.

The exchange runs on the host, off the GPU's critical path: on the group itself when it takes CPU tensors
(gloo, or a ``"cpu:gloo,cuda:nccl"`` group), else on a gloo process group over the same ranks, created on the
first agreement of the group (from the group's own store, so no other rank of the job takes part) and kept
for the life of the process. The host therefore never waits for the device: no device synchronisation.
Every row has the same size, so two ranks in different calls meet in the same exchange and are told so
(instead of crossing collectives of different sizes, which gloo answers by aborting the process).

When the exchange itself fails (a peer died, or never arrived before the group's timeout), the error is an
:class:`ExchangeError` naming this rank, the call and, where the store can tell, the ranks that did not
answer (:func:`unresponsive_ranks`).
"""

from __future__ import annotations

import datetime
import hashlib
import pickle
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MAX_EXTRA", "ROW", "AgreementError", "ExchangeError", "agree", "host_group_of", "pair_checksum",
    "unresponsive_ranks",
]  # fmt: skip

ROW = 16
"""int64 values each rank sends per agreement (the same for every call, so ranks in different calls meet)."""
_MAGIC = 0x4D41_4749_0001  # "MAGI", protocol 1: a row from anything else is recognised as foreign
_HEAD = 5  # magic, status, call hash, hash of the values that must agree, number of extra integers
MAX_EXTRA = ROW - _HEAD
_OK, _FAILED = 0, 1


class AgreementError(ValueError):
    """Another rank of the group failed this call, is in another call, or passed different values.

    Attributes:
        call: the call this rank was in.
        ranks: the ranks the message is about (the failing ones, or the ones on the minority side).
    """

    def __init__(self, message: str, *, call: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.call = call
        self.ranks = list(ranks)


class ExchangeError(RuntimeError):
    """The status exchange itself failed or timed out (a peer died, stopped, or never reached the call).

    Attributes:
        call: the call this rank was in.
        rank: this rank (in the group).
        detail: the backend's error and what the store says about the peers.
    """

    def __init__(self, message: str, *, call: str, rank: int, detail: str) -> None:
        super().__init__(message)
        self.call, self.rank, self.detail = call, rank, detail


def _h(value: object) -> int:
    """A 63-bit hash, the same in every process (Python's `hash` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


def pair_checksum(pairs: Mapping[tuple[int, int], object]) -> int:
    """Sum (mod 2**63) of a hash per (sender, receiver) entry: senders and receivers that describe the same
    traffic give the same total, so one integer per rank checks every pair (a mismatch names no pair; the
    caller then gathers the full tables to say which)."""
    return sum(_h((s, r, v)) for (s, r), v in pairs.items()) % (1 << 63)


def _as_int64(value: object) -> int:
    """An int64 for the row: ints as they are, floats by their bits, anything else by its hash."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and -(1 << 63) <= value < (1 << 63):
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return _h(value)


# -- the host group -------------------------------------------------------------------------------------------
class _HostGroup:
    """All-gathers on the host for one process group: the group itself, or a gloo backend beside it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.name = getattr(group, "group_name", "?")
        self.backend: Any = None  # a ProcessGroupGloo of our own when the group takes no CPU tensors
        self.seq = 0  # agreements run on this group by this rank (for the diagnosis of a failure)
        if not _takes_cpu_tensors(group) or _FORCE_OWN_GLOO:
            self.backend = _own_gloo(group, self.rank, self.size)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(self.size)]
        if self.backend is None:
            dist.all_gather(parts, t, group=self.group)
        else:
            self.backend.allgather([parts], [t]).wait()
        return parts

    def gather_bytes(self, data: bytes) -> list[bytes]:
        sizes = [int(x) for x in self.gather(torch.tensor([len(data)], dtype=torch.int64))]
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        return [p[:n].numpy().tobytes() for p, n in zip(self.gather(buf), sizes)]


_FORCE_OWN_GLOO = False  # tests: take the path NCCL-only groups take (a gloo backend of our own) on CPU
_HOST: dict[int, tuple[dist.ProcessGroup, _HostGroup]] = {}
_HOST_LOCK = threading.Lock()


def _takes_cpu_tensors(group: dist.ProcessGroup) -> bool:
    try:
        group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    return True


def _group_store(group: dist.ProcessGroup) -> Any:
    """The group's own store (prefixed for it by torch.distributed), or None when it cannot be found."""
    try:
        return dist.distributed_c10d._world.pg_map[group][1]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def _group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return dist.default_pg_timeout


def _own_gloo(group: dist.ProcessGroup, rank: int, size: int) -> Any:
    """A gloo backend over the group's ranks, rendezvousing through the group's store under a prefix of ours:
    only the members take part (unlike `dist.new_group`, which every rank of the job must enter), and the
    key space cannot collide with torch's own groups."""
    store = _group_store(group)
    if store is None:
        raise RuntimeError(
            f"magi status agreement: cannot find the store of process group {getattr(group, 'group_name', '?')!r} "
            "to create a gloo group beside it; create the group with a CPU backend too, e.g. "
            "dist.new_group(ranks, backend='cpu:gloo,cuda:nccl')"
        )
    prefixed = dist.PrefixStore("magi_status_agreement/", store)
    return dist.ProcessGroupGloo(prefixed, rank, size, _group_timeout(group))


def host_group_of(group: dist.ProcessGroup) -> _HostGroup:
    """The host exchange of `group` (created on first use: collective over the group's ranks)."""
    entry = _HOST.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    with _HOST_LOCK:
        host = _HostGroup(group)
        _HOST[id(group)] = (group, host)
    return host


# -- the agreement --------------------------------------------------------------------------------------------
def _summary(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 600 else text[:600] + " ..."


def _show(value: object) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def agree(
    group: dist.ProcessGroup,
    call: str,
    *,
    error: BaseException | None = None,
    same: Mapping[str, object] | None = None,
    extra: Sequence[int] = (),
) -> list[list[int]]:
    """Agree with every rank of `group` that the call can go on; raise on every rank when it cannot.

    Args:
        group: the process group of the collective (its flat group).
        call: what this rank is doing, e.g. ``"group_cast"`` or ``"calc_attn (forward)"``; ranks whose calls
            differ raise :class:`AgreementError` saying which rank is in which call.
        error: this rank's local validation error, or None. It is re-raised here after the exchange (the
            other ranks raise :class:`AgreementError` naming this rank and the error's text).
        same: named values every rank must pass alike (ints, floats, dtypes, shapes: compared by value);
            the first one that differs is named with the ranks on each side.
        extra: at most ``MAX_EXTRA`` int64 values returned per rank for the caller's own checks.

    Returns:
        `extra` of every rank, in rank order (when every rank is ok, in the same call, with the same values).

    Raises:
        `error` on the rank that passed it; AgreementError on the others; ExchangeError when the exchange
        fails (a peer died, or did not arrive before the group's timeout).
    """
    same = dict(same or {})
    if len(extra) > MAX_EXTRA:
        raise AssertionError(f"at most {MAX_EXTRA} extra values per agreement, got {len(extra)}")
    world = dist.get_world_size(group)
    if world == 1:
        if error is not None:
            raise error
        return [list(extra)]
    host = host_group_of(group)
    host.seq += 1
    same_items = tuple((name, _as_int64(v)) for name, v in same.items())
    row = [_MAGIC, _FAILED if error is not None else _OK, _h(call), _h(same_items), len(extra), *extra]
    row += [0] * (ROW - len(row))
    rows = [p.tolist() for p in _exchange(host, call, torch.tensor(row, dtype=torch.int64))]
    foreign = [r for r, x in enumerate(rows) if x[0] != _MAGIC]
    if foreign:  # nothing more can be exchanged with a rank that runs another protocol
        raise AgreementError(
            f"{_where(host)}: rank(s) {foreign} are in another collective, not in the status agreement of "
            f"{call}: every rank must make the same calls in the same order",
            call=call,
            ranks=foreign,
        )
    if error is None and all(x[1] == _OK and x[2:4] == row[2:4] for x in rows):
        return [x[_HEAD : _HEAD + x[4]] for x in rows]
    # Something differs: every rank saw the same rows, so every rank takes this second exchange too.
    mine = (call, None if error is None else _summary(error), [(n, v, _show(same[n])) for n, v in same_items])
    infos = [pickle.loads(b) for b in _exchange_bytes(host, call, pickle.dumps(mine))]
    if error is not None:
        raise error
    raise _disagreement(host, call, rows, infos)


def _disagreement(host: _HostGroup, call: str, rows: list[list[int]], infos: list[tuple]) -> AgreementError:
    failed = [r for r, x in enumerate(rows) if x[1] != _OK]
    if failed:
        reasons = "; ".join(
            f"rank {r}: {infos[r][1]}"
            if infos[r][0] == call
            else f"rank {r}, in {infos[r][0]}: {infos[r][1]}"
            for r in failed
        )
        return AgreementError(
            f"{_where(host)}, in {call}: other rank(s) {failed} rejected their input ({reasons}); rank "
            f"{host.rank} stops too instead of waiting for them in a collective",
            call=call,
            ranks=failed,
        )
    calls = [info[0] for info in infos]
    if len(set(calls)) > 1:
        where = ", ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
        odd = _minority(calls)
        return AgreementError(
            f"{_where(host)}: ranks are in different calls ({where}); every rank of the group must make the "
            "same collective calls in the same order",
            call=call,
            ranks=odd,
        )
    problems, odd_ranks = [], []
    for i, (name, _, _) in enumerate(infos[0][2]):
        sides: dict[int, list[int]] = {}
        shown: dict[int, str] = {}
        for r, info in enumerate(infos):
            value = info[2][i][1] if i < len(info[2]) else None
            sides.setdefault(value, []).append(r)
            shown[value] = info[2][i][2] if i < len(info[2]) else "?"
        if len(sides) > 1:
            problems.append(
                f"`{name}` differs: " + ", ".join(f"ranks {rs}: {shown[v]}" for v, rs in sides.items())
            )
            odd_ranks += min(sides.values(), key=len)
    return AgreementError(
        f"{_where(host)}: ranks passed different arguments to {call}: "
        + ("; ".join(problems) or "(values differ)")
        + "; every rank must pass the same values",
        call=call,
        ranks=sorted(set(odd_ranks)),
    )


def _minority(values: list[str]) -> list[int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    common = max(counts, key=lambda v: counts[v])
    return [r for r, v in enumerate(values) if v != common]


def _where(host: _HostGroup) -> str:
    return f"rank {host.rank} of group {host.name!r} ({host.size} ranks)"


def _exchange(host: _HostGroup, call: str, row: torch.Tensor) -> list[torch.Tensor]:
    try:
        return host.gather(row)
    except RuntimeError as exc:
        raise _exchange_error(host, call, exc) from exc


def _exchange_bytes(host: _HostGroup, call: str, data: bytes) -> list[bytes]:
    try:
        return host.gather_bytes(data)
    except RuntimeError as exc:
        raise _exchange_error(host, call, exc) from exc


def _exchange_error(host: _HostGroup, call: str, exc: BaseException) -> ExchangeError:
    peers = unresponsive_ranks(host.group, f"{call} #{host.seq}")
    detail = f"{exc}".strip()
    if peers:
        detail += f"\n({peers})"
    return ExchangeError(
        f"{_where(host)}: the status agreement of {call} failed: {detail}\n(a peer rank failed, stopped or "
        "never reached this call; the wait is bounded by the process group's timeout)",
        call=call,
        rank=host.rank,
        detail=detail,
    )


def unresponsive_ranks(group: dist.ProcessGroup, where: str, grace_s: float = 2.0) -> str:
    """After a failed collective: which ranks of `group` still answer, through the group's store.

    Each rank that runs this writes `where` (the call and this rank's count of agreements on the group) and
    waits up to `grace_s` for the same note from the others; the ranks that wrote none in that time are dead
    or blocked elsewhere (their last note, if any, is shown). Best effort: returns "" when the store cannot
    be reached (its host, rank 0 of the job, may be the one that died).
    """
    store = _group_store(group)
    if store is None:
        return ""
    try:
        me, size = dist.get_rank(group), dist.get_world_size(group)
        store.set(f"magi_status_diagnosis/{me}", where)
        deadline = time.monotonic() + grace_s
        missing = [r for r in range(size) if r != me]
        last: dict[int, str] = {}
        while True:
            for r in list(missing):
                key = f"magi_status_diagnosis/{r}"
                if store.check([key]):
                    last[r] = store.get(key).decode(errors="replace")
                    if last[r] == where:
                        missing.remove(r)
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    except Exception:  # the store is gone (its host died) or unusable: nothing more to say
        return ""
    notes = []
    if missing:
        seen = "".join(f"; rank {r}'s last failure note: {last[r]}" for r in missing if r in last)
        notes.append(
            f"rank(s) {missing} did not report within {grace_s:g} s: dead, or blocked elsewhere{seen}"
        )
    here = [r for r in range(size) if r != me and r not in missing]
    if here:
        notes.append(f"rank(s) {here} failed here too")
    return "; ".join(notes)
