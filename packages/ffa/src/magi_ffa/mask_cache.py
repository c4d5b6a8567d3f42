"""A cache of per-mask launch data keyed by the *values* of the slice tables, for every kernel backend.

Backends that turn a slice mask into launch data (FA4's block lists, cuDNN's mask plans) build it once per
distinct mask and reuse it on every call of a training step: the key is the bytes of the three slice tables
plus the sizes, the device and whatever else the data depends on (``extra``: head counts, dtype, tile
sizes). A second dict keyed by tensor identity (checked with weak references and the tensors' version
counters) lets a repeated call with the very same tensors skip the device->host copy that the value key
needs, so a cached call costs a dictionary lookup.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

from ._common import RangesLike, TypeMapLike, check_slice_values, slices_on_device

__all__ = ["MaskValueCache"]

T = TypeVar("T")


class MaskValueCache(Generic[T]):
    """LRU of ``capacity`` entries, one per (mask value, sizes, device, extra).

    ``get`` validates the slices (ValueError naming the bad one) only when it builds an entry: a hit was
    validated when it was built.
    """

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"`capacity` must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._by_value: OrderedDict[tuple, T] = OrderedDict()
        self._by_identity: dict[tuple, tuple] = {}

    def __len__(self) -> int:
        return len(self._by_value)

    def clear(self) -> None:
        """Drop every entry (frees their device tensors)."""
        self._by_value.clear()
        self._by_identity.clear()

    def get(
        self,
        tables: tuple[RangesLike, RangesLike, TypeMapLike],
        *,
        total_q: int,
        total_k: int,
        device: torch.device,
        build: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], T],
        extra: Hashable = (),
        host_tables: bool = False,
    ) -> T:
        """The cached entry of the mask ``tables`` = ``(q_ranges, k_ranges, attn_type_map)``, or
        ``build(q_ranges, k_ranges, type_map)`` (int32 tensors on ``device``, validated) stored and returned.

        ``host_tables=True`` hands ``build`` the tables on the CPU instead (the copy the value key reads), for
        a backend that builds its launch data on the host: copying them to the device and back would cost two
        round trips, each waiting for the kernels already queued on the stream."""
        raw = tuple(tables)
        q_ranges, k_ranges, attn_type_map = raw
        ikey = self._identity_key(raw, total_q, total_k, device, extra)
        if ikey is not None:
            hit = self._by_identity.get(ikey)
            if hit is not None:
                refs, vkey = hit
                if all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, raw)):
                    entry = self._by_value.get(vkey)
                    if entry is not None:
                        self._by_value.move_to_end(vkey)
                        return entry
        # the value key is read on the host: host tables cost no device round trip (tables on the device
        # cost one copy to the host, the sync the value key needs)
        qr, kr, tm = slices_on_device(q_ranges, k_ranges, attn_type_map, torch.device("cpu"))
        packed = torch.cat([qr.reshape(-1), kr.reshape(-1), tm])
        vkey = (packed.numpy().tobytes(), qr.shape[0], total_q, total_k, str(device), extra)
        entry = self._by_value.get(vkey)
        if entry is None:
            check_slice_values(qr, kr, tm, total_q, total_k)
            entry = build(qr, kr, tm) if host_tables else build(*(t.to(device) for t in (qr, kr, tm)))
            self._by_value[vkey] = entry
            while len(self._by_value) > self.capacity:
                self._by_value.popitem(last=False)
        else:
            self._by_value.move_to_end(vkey)
        if ikey is not None:
            if len(self._by_identity) > 4 * self.capacity:
                self._by_identity.clear()
            self._by_identity[ikey] = (tuple(weakref.ref(t) if t is not None else None for t in raw), vkey)
        return entry

    @staticmethod
    def _identity_key(raw: tuple, total_q: int, total_k: int, device: torch.device, extra: Hashable):
        if not all(t is None or isinstance(t, torch.Tensor) for t in raw):
            return None
        ids = tuple((id(t), t._version) if t is not None else None for t in raw)
        return (ids, total_q, total_k, str(device), extra)
