"""The one cache of per-mask data of every kernel backend: checked slices plus each backend's launch data.

A mask (three slice tables and the token counts they index) has ONE entry, a
:class:`~magi_ffa.validation.CheckedSlices`: the tables checked once and rewritten into disjoint host slices,
and in its ``prepared`` dict each backend's launch data (magi_ffa's host slices, FA4's launch metadata,
cuDNN's mask plans), keyed by the backend's name first, then whatever the data depends on (geometry,
device). :meth:`MaskValueCache.lookup` finds the entry

1. by the identity and version counter of the table objects the caller passes (weak references: the cache
   never keeps a caller's table alive), before any dtype conversion, so that a repeated call with the same
   tensors, on the host or on a GPU, int32 or int64, costs a dictionary lookup and no host synchronization;
   the entry's own int32 host tables are registered too, so that the ``magi_ffa::fwd`` / ``magi_ffa::bwd``
   custom ops, which receive them, find the entry the same way;
2. else by value (one device->host copy of the tables, then their bytes): a new tensor holding a known mask
   reuses the entry (and its launch data), and is registered by identity for the next call.

A table changed in place bumps its version counter: the identity record no longer matches and the next
lookup reads the values again (a write that bypasses the counter, such as a custom kernel writing through the
raw pointer, is not seen: pass a new tensor then, or call :func:`clear_mask_caches`). Inference-mode tensors
have no version counter and are always read by value. The cache is bounded in entries and in bytes (the tensor bytes an entry holds,
its tables and its launch data, each storage counted once), least recently used first; a backend may also
cap how many entries hold its data (:meth:`MaskValueCache.limit`). One lock makes it thread-safe (builds run
under it, so two threads never build the same data twice). :func:`clear_mask_caches` empties it.
"""

from __future__ import annotations

import dataclasses
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch

from . import env
from ._common import CheckedSlices, RangesLike, TypeMapLike, _host_slices_cached, host_tables

__all__ = ["MASKS", "MaskValueCache", "check_slices", "clear_mask_caches", "data_nbytes"]

T = TypeVar("T")
_CPU = torch.device("cpu")
_ID_SLACK = 8
"""Identity records kept per entry at most (callers that pass a fresh tensor of a known mask every call add
one record each; the oldest are dropped)."""


_OPAQUE = (types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def data_nbytes(obj: object) -> int:
    """Bytes of the tensors reachable from ``obj`` through dataclass fields, tuples, lists, dict values and
    plain objects' attributes (a few levels deep), each storage counted once (views of one buffer, data shared
    by two slots)."""
    seen: set[tuple] = set()
    return _walk(obj, seen, set(), 6)


def _walk(obj: object, seen: set, visited: set, depth: int) -> int:
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = (str(obj.device), storage.data_ptr(), storage.nbytes())
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if depth == 0 or id(obj) in visited or isinstance(obj, str | bytes | int | float | type):
        return 0
    visited.add(id(obj))
    if isinstance(obj, tuple | list | set | frozenset):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif dataclasses.is_dataclass(obj):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, _OPAQUE):
        items = list(vars(obj).values())
    else:
        return 0
    return sum(_walk(x, seen, visited, depth - 1) for x in items)


@dataclasses.dataclass(slots=True)
class _Entry:
    checked: CheckedSlices
    nbytes: int
    ikeys: list = dataclasses.field(default_factory=list)


class MaskValueCache:
    """LRU of mask entries (see the module docstring), at most ``capacity`` entries and ``max_bytes`` bytes.

    Args:
        capacity: entries kept (>= 1).
        max_bytes: tensor bytes kept over all entries (>= 1); the entry in use is kept even when it alone
            holds more.
    """

    def __init__(self, capacity: int, max_bytes: int = 1 << 30) -> None:
        for name, val in (("capacity", capacity), ("max_bytes", max_bytes)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"`{name}` must be a positive int, got {val!r}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._lock = threading.RLock()
        self._by_value: OrderedDict[tuple, _Entry] = OrderedDict()
        self._by_identity: dict[tuple, tuple[tuple, tuple]] = {}
        self._vkey_of: dict[int, tuple] = {}  # id(checked) -> its value key (checked against the entry)
        self._limits: dict[str, int] = {}
        self._holders: dict[str, OrderedDict[tuple, None]] = {}  # backend -> entries holding its data, LRU
        self._orphans: weakref.WeakSet[CheckedSlices] = weakref.WeakSet()
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._by_value)

    @property
    def nbytes(self) -> int:
        """Tensor bytes the entries hold now (tables and launch data)."""
        return self._nbytes

    # ------------------------------------------------------------------------------------------- lookup
    def lookup(
        self,
        tables: tuple[RangesLike, RangesLike, TypeMapLike],
        *,
        total_q: int,
        total_k: int,
        device: torch.device | None = None,
    ) -> CheckedSlices:
        """The entry of the mask ``tables = (q_ranges, k_ranges, attn_type_map)`` over ``total_q`` x
        ``total_k`` tokens: found by the tables' identity and version, else by value, else checked (ValueError
        / TypeError naming the bad table or slice, as ``ffa_fwd``) and stored.

        Args:
            tables: int32 / int64 tensors on ``device`` or the CPU, or lists (``attn_type_map``: also None,
                one type, names); lists have no identity and are read by value.
            total_q, total_k: the query and key tokens the ranges index.
            device: q's device (tables on another GPU are refused); None: the CPU.
        """
        device = _CPU if device is None else device
        raw = tuple(tables)
        ikey = _identity_key(raw, total_q, total_k)
        with self._lock:
            if ikey is not None:
                hit = self._identity_hit(ikey, raw, device)
                if hit is not None:
                    return hit
            qr, kr, tm = host_tables(*raw, device)  # one device->host copy for tables on a GPU
            if kr.shape[0] != qr.shape[0]:
                raise ValueError(
                    f"`q_ranges` and `k_ranges` must have the same number of slices, got {qr.shape[0]} and "
                    f"{kr.shape[0]}"
                )
            packed = torch.cat([qr, kr, tm[:, None]], dim=1)
            vkey = (packed.numpy().tobytes(), qr.shape[0], total_q, total_k)
            entry = self._by_value.get(vkey)
            if entry is None:
                entry = self._insert(vkey, qr, kr, tm)
            else:
                self._by_value.move_to_end(vkey)
            if ikey is not None:
                self._register(ikey, raw, vkey, entry)
            return entry.checked

    def _identity_hit(self, ikey: tuple, raw: tuple, device: torch.device) -> CheckedSlices | None:
        rec = self._by_identity.get(ikey)
        if rec is None:
            return None
        refs, vkey = rec
        for r, t in zip(refs, raw):
            if t is None:
                continue
            if r() is not t or (t.device.type != "cpu" and t.device != device):
                return None  # another tensor at a recycled address, or a table on another GPU
        entry = self._by_value.get(vkey)
        if entry is None:
            return None
        self._by_value.move_to_end(vkey)
        return entry.checked

    def _insert(self, vkey: tuple, qr: torch.Tensor, kr: torch.Tensor, tm: torch.Tensor) -> _Entry:
        n, total_q, total_k = vkey[1:]
        if not isinstance(total_q, int) or not isinstance(total_k, int) or total_q < 0 or total_k < 0:
            raise ValueError(f"`total_q` and `total_k` must be ints >= 0, got {total_q!r} and {total_k!r}")
        slices = _host_slices_cached(vkey[0], n, total_q, total_k) if n else ()
        checked = CheckedSlices(slices, total_q, total_k, qr, kr, tm)
        entry = _Entry(checked, data_nbytes((qr, kr, tm)))
        self._by_value[vkey] = entry
        self._vkey_of[id(checked)] = vkey
        self._nbytes += entry.nbytes
        # the entry's own tables: what the custom ops receive from the eager path
        self._register(_identity_key((qr, kr, tm), total_q, total_k), (qr, kr, tm), vkey, entry)
        self._shrink(vkey)
        return entry

    def _register(self, ikey: tuple, raw: tuple, vkey: tuple, entry: _Entry) -> None:
        refs = tuple(None if t is None else weakref.ref(t) for t in raw)
        self._by_identity[ikey] = (refs, vkey)
        entry.ikeys.append(ikey)
        if len(entry.ikeys) > _ID_SLACK:
            old = entry.ikeys.pop(1)  # the entry's own tables (index 0) stay registered
            if self._by_identity.get(old, (None, None))[1] == vkey:
                del self._by_identity[old]

    # ------------------------------------------------------------------------------------ launch data
    def prepared(self, checked: CheckedSlices, key: tuple, build: Callable[[], T]) -> T:
        """The launch data ``key`` of ``checked``'s mask (``key[0]``: the backend's name), built by ``build()``
        on first use and counted against the bounds. Checked slices that are no entry (an evicted one a caller
        still holds) keep their data themselves, outside the bounds; :meth:`clear` empties them too."""
        with self._lock:
            if key in checked.prepared:
                data = checked.prepared[key]
                vkey = self._vkey_of.get(id(checked))
                if vkey is not None and vkey in self._by_value:
                    self._by_value.move_to_end(vkey)
                    self._touch(key[0], vkey)
                return data
            data = checked.prepared[key] = build()
            vkey = self._vkey_of.get(id(checked))
            entry = None if vkey is None else self._by_value.get(vkey)
            if entry is None or entry.checked is not checked:
                self._orphans.add(checked)
                return data
            size = data_nbytes((checked.q_ranges, checked.k_ranges, checked.types, checked.prepared))
            self._nbytes += size - entry.nbytes
            entry.nbytes = size
            self._by_value.move_to_end(vkey)
            self._touch(key[0], vkey)
            self._shrink(vkey)
            return data

    def limit(self, backend: str, entries: int) -> None:
        """Keep ``backend``'s launch data in at most ``entries`` entries (its least recently used data is
        dropped first; the entries themselves stay)."""
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 1:
            raise ValueError(f"`entries` must be a positive int, got {entries!r}")
        with self._lock:
            self._limits[backend] = entries

    def drop(self, backend: str) -> None:
        """Drop ``backend``'s launch data from every entry (the checked slices stay)."""
        with self._lock:
            for entry in self._by_value.values():
                self._drop_data(entry, backend)
            for checked in list(self._orphans):
                for key in [k for k in checked.prepared if k[0] == backend]:
                    del checked.prepared[key]
            self._holders.pop(backend, None)

    def clear(self) -> None:
        """Drop every entry and every backend's launch data (frees their device tensors)."""
        with self._lock:
            for entry in self._by_value.values():
                entry.checked.prepared.clear()
            for checked in list(self._orphans):
                checked.prepared.clear()
            self._by_value.clear()
            self._by_identity.clear()
            self._vkey_of.clear()
            self._holders.clear()
            self._orphans = weakref.WeakSet()
            self._nbytes = 0

    # -------------------------------------------------------------------------------------- bounds
    def _touch(self, backend: str, vkey: tuple) -> None:
        holders = self._holders.setdefault(backend, OrderedDict())
        holders[vkey] = None
        holders.move_to_end(vkey)
        cap = self._limits.get(backend)
        while cap is not None and len(holders) > cap:
            old, _ = holders.popitem(last=False)
            if old in self._by_value:
                self._drop_data(self._by_value[old], backend)

    def _drop_data(self, entry: _Entry, backend: str) -> None:
        prepared = entry.checked.prepared
        keys = [k for k in prepared if k[0] == backend]
        if not keys:
            return
        for k in keys:
            del prepared[k]
        c = entry.checked
        size = data_nbytes((c.q_ranges, c.k_ranges, c.types, prepared))
        self._nbytes += size - entry.nbytes
        entry.nbytes = size

    def _shrink(self, keep: tuple) -> None:
        while len(self._by_value) > 1 and (
            len(self._by_value) > self.capacity or self._nbytes > self.max_bytes
        ):
            vkey = next(iter(self._by_value))
            if vkey == keep:  # the entry in use is the most recent: only reached when it alone is left
                break
            entry = self._by_value.pop(vkey)
            self._nbytes -= entry.nbytes
            for ikey in entry.ikeys:
                if self._by_identity.get(ikey, (None, None))[1] == vkey:
                    del self._by_identity[ikey]
            self._vkey_of.pop(id(entry.checked), None)
            for holders in self._holders.values():
                holders.pop(vkey, None)
            # its launch data goes too (device memory), even where a caller still holds the checked slices
            entry.checked.prepared.clear()


def _identity_key(raw: tuple, total_q: int, total_k: int) -> tuple | None:
    """``((id, version) per table, total_q, total_k)``, or None when a table is no tensor (a list has no
    identity) or has no version counter (an inference-mode tensor)."""
    ids = []
    for t in raw:
        if t is None:
            ids.append(None)
        elif isinstance(t, torch.Tensor):
            try:
                ids.append((id(t), t._version))
            except RuntimeError:  # inference tensors track no version
                return None
        else:
            return None
    return (tuple(ids), total_q, total_k)


MASKS = MaskValueCache(env.mask_cache_size(), env.mask_cache_bytes())
"""The process's one mask cache (``MAGI_FFA_MASK_CACHE`` entries, ``MAGI_FFA_MASK_CACHE_MB`` MiB of tensors):
every backend's public functions and the runtime's checked slices go through it."""


def check_slices(
    q_ranges: RangesLike, k_ranges: RangesLike, attn_type_map: TypeMapLike, total_q: int, total_k: int
) -> CheckedSlices:
    """Every check ``ffa_fwd`` makes of the slice tables (shapes, dtypes, int32 range, values against
    ``total_q`` / ``total_k``), once: the mask's entry of :data:`MASKS` (equal masks share one entry and its
    backends' launch data). Host tables (CPU tensors or lists) avoid a device->host copy."""
    if not isinstance(total_q, int) or not isinstance(total_k, int) or total_q < 0 or total_k < 0:
        raise ValueError(f"`total_q` and `total_k` must be ints >= 0, got {total_q!r} and {total_k!r}")
    return MASKS.lookup((q_ranges, k_ranges, attn_type_map), total_q=total_q, total_k=total_k)


def clear_mask_caches() -> None:
    """Empty the mask cache: every mask's checked slices and every registered backend's launch data (FA4's
    launch metadata, cuDNN's mask plans; frees their device tensors). Local to this process. Call it after
    changing a setting that launch data is built from (e.g. ``MAGI_FFA_FA4_R2P``), or to free memory."""
    MASKS.clear()
    _host_slices_cached.cache_clear()
