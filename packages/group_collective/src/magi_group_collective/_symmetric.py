"""Symmetric device buffers for the native group collectives: one long-lived buffer per (process group,
device), mapped into every rank of the group.

How: each rank ``cudaMalloc``\\ s one allocation (a multiple of 2 MiB), exports it with
``cudaIpcGetMemHandle`` and the 64-byte handles are exchanged once with ``all_gather_object`` over the
group; every rank opens its peers' handles with ``cudaIpcOpenMemHandle(...,
cudaIpcMemLazyEnablePeerAccess)`` (one handle per allocation, the device set first). Kernels then address a
peer's buffer as ``my_buffer + delta[peer]``: ``delta`` is the difference of the two base addresses in this
process, kept as an int64 device tensor in units of 256 bytes (``UNIT_BYTES``), so the hot path allocates
nothing and does no rendezvous. The buffer grows (doubling) when a call needs more room: the size is a
function of the plan, which every rank knows identically (all tables are gathered at plan construction),
and of the row size of the call, so every rank grows at the same call; growing is collective and
synchronises the device.

Why cuda-python IPC handles, and not the alternatives:

- nvshmem4py is not installed on the machines this is run on (the NVSHMEM library is, without its Python
  bindings), so it would have to travel as a wheel; and its symmetric heap needs NVSHMEM initialised across
  the ranks (a bootstrap of its own beside torch.distributed) before any allocation. Intra-node peer
  pointers are all the native kernels need, and CUDA IPC gives exactly that with one dependency,
  ``cuda-bindings`` (the low-level package of cuda-python), which is an optional extra of this package.
- ``torch.distributed._symmetric_memory`` is private (no stability promise across torch releases) and is
  not used.
- NVLink multicast objects are never created (no ``cuMulticastCreate``): plain peer loads only.

Synchronisation between the GPUs is a stream-ordered barrier: an ``all_reduce`` of one int32 on the
group's NCCL communicator, issued on the buffer's communication stream. It completes on a rank only after
every rank's earlier work on that stream has completed, costs no host synchronisation, and inherits NCCL's
error handling and timeouts (a spinning flag kernel would hang silently if a peer died).

Lifetime: buffers live until :func:`release_buffers` (collective: a rank must not free memory a peer
still maps, which CUDA leaves undefined) or process exit, when the driver unmaps and frees everything.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import env
from ._comm import Comm
from ._native_plan import UNIT_BYTES, align_up

_GRANULE = 2 << 20  # whole 2 MiB pages: never a sub-allocation of a shared page, safe to export
_MIN_BYTES = 4 << 20


class NativeUnavailableError(RuntimeError):
    """The native group collectives cannot run with this group / device / installation (raised on every
    rank alike, before any data moves)."""


# Names the row of the install table (docs/install.md) that brings the `native` extra.
INSTALL_HINT = 'cuda-bindings >= 13, the `native` extra of magi-group-collective: install row "native" (python scripts/install.py native, docs/install.md)'


def native_requirements() -> str:
    """One sentence: what the native implementation needs."""
    return (
        "It needs CUDA tensors, an NCCL process group whose ranks all sit on one node, one GPU per rank "
        f"with peer access between them, and cuda-bindings ({INSTALL_HINT})"
    )


def import_cudart():
    """``cuda.bindings.runtime``, or NativeUnavailableError saying how to install it."""
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise NativeUnavailableError(
            f"the native group collectives need cuda-python's cuda-bindings, which is not importable "
            f"({exc}); {INSTALL_HINT}"
        ) from None
    return runtime


def _check(rt, result, what: str):
    """Unpack a cuda-bindings result tuple ``(err, *values)``; raise RuntimeError on an error code."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        _, msg = rt.cudaGetErrorString(err)
        raise RuntimeError(f"{what} failed: {err.name if hasattr(err, 'name') else err} ({msg.decode()})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(slots=True)
class SymSpace:
    """What the native kernels need to address every rank's buffer from this rank.

    Attributes:
        local: ``[capacity]`` uint8 tensor over this rank's buffer (its base is 256-byte aligned).
        deltas: ``[W]`` int64 on the buffer's device: ``(base of rank p's buffer - local base) / UNIT_BYTES``
            in this process's address space (0 for this rank).
        rank: this rank.
    """

    local: torch.Tensor
    deltas: torch.Tensor
    rank: int

    @property
    def capacity(self) -> int:
        return self.local.numel()

    def slot_offset(self, slot: int) -> int:
        """Byte offset of staging slot 0 or 1 (the buffer is split in two halves, used alternately)."""
        half = (self.capacity // 2) // UNIT_BYTES * UNIT_BYTES
        return slot * half

    @property
    def slot_bytes(self) -> int:
        return (self.capacity // 2) // UNIT_BYTES * UNIT_BYTES


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _tensor_over(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 torch tensor over device memory this module owns (no copy; the tensor does not free it)."""

    class _Mem:
        def __init__(self) -> None:
            self.__cuda_array_interface__ = {
                "shape": (nbytes,),
                "typestr": "|u1",
                "data": (ptr, False),
                "version": 2,
            }

    t = torch.as_tensor(_Mem(), device=device)
    # a copy would silently break every peer's view of this buffer
    if t.data_ptr() != ptr or t.device != device:  # pragma: no cover
        raise RuntimeError("could not wrap the symmetric buffer as a tensor without a copy")
    return t


class NativeBuffer:
    """The symmetric buffer of one (process group, device): staging slots, peer deltas, a comm stream.

    Construction and :meth:`reserve` growth are collective over ``comm.group`` (host-side
    ``all_gather_object``); every call of the native collectives on this group goes through this object in
    the same order on every rank, so slot alternation and growth decisions agree across ranks.
    """

    def __init__(self, comm: Comm, device: torch.device, nbytes: int = _MIN_BYTES) -> None:
        self.comm = comm
        self.group = comm.group
        self.device = device
        self._dev = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = torch.cuda.Stream(device=device)
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)  # the NCCL barrier's operand
        self._ptr = 0
        self._peers: dict[int, int] = {}
        self._calls = 0
        self.space: SymSpace | None = None
        self._map(align_up(max(nbytes, _MIN_BYTES), _GRANULE))

    # ------------------------------------------------------------------------------ collective setup
    def _gather(self, obj) -> list:
        out: list = [None] * self.comm.world_size
        with torch.cuda.device(self.device):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def _map(self, nbytes: int) -> None:
        """Allocate ``nbytes`` here, exchange handles, open every peer's; raise on every rank alike."""
        me, W = self.comm.rank, self.comm.world_size
        dev = self._dev
        record = {
            "host": _host_id(),
            "hostname": socket.gethostname(),
            "error": None,
            "handle": None,
            "nbytes": nbytes,
        }
        rt = None
        try:
            record["uuid"] = str(torch.cuda.get_device_properties(dev).uuid)
            record["visible"] = [
                str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())
            ]
            rt = import_cudart()
            _check(rt, rt.cudaSetDevice(dev), f"cudaSetDevice({dev})")
            self._ptr = _check(rt, rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes})")
            _check(rt, rt.cudaMemset(self._ptr, 0, nbytes), "cudaMemset")
            _check(rt, rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            handle = _check(rt, rt.cudaIpcGetMemHandle(self._ptr), "cudaIpcGetMemHandle")
            record["handle"] = bytes(handle.reserved)
        except Exception as exc:  # reported by every rank below
            record["error"] = f"{type(exc).__name__}: {exc}"
        records = self._gather(record)
        problems = [f"rank {r}: {rec['error']}" for r, rec in enumerate(records) if rec["error"]]
        hosts = {rec["host"] for rec in records}
        if len(hosts) > 1:
            names = sorted({rec["hostname"] for rec in records})
            problems.append(
                f"the group spans {len(hosts)} nodes ({', '.join(names)}); native is intra-node only"
            )
        sizes = [rec["nbytes"] for rec in records]
        if len(set(sizes)) > 1:  # every rank must map the same size, or the next growth is not collective
            problems.append(
                f"the ranks asked for buffers of different sizes (MiB by rank: {[b >> 20 for b in sizes]}); "
                "MAGI_GROUP_COLLECTIVE_NATIVE_BUFFER_MB must be equal on every rank"
            )
        uuids = [rec.get("uuid") for rec in records]
        for r in range(W):
            for q in range(r):
                if uuids[r] is not None and uuids[r] == uuids[q]:
                    problems.append(
                        f"ranks {q} and {r} use the same GPU ({uuids[r]}); native needs one GPU per rank"
                    )
        if problems:
            self._free_own(rt)
            raise NativeUnavailableError(
                "cannot set up the native group collectives' symmetric buffers:\n  " + "\n  ".join(problems)
            )
        # open every peer's allocation; report failures collectively
        error = None
        peers: dict[int, int] = {}
        try:
            mine = records[me]["visible"]
            for p in range(W):
                if p == me:
                    continue
                if uuids[p] in mine:  # peer visible here: ask the driver before mapping
                    can = _check(
                        rt, rt.cudaDeviceCanAccessPeer(dev, mine.index(uuids[p])), "cudaDeviceCanAccessPeer"
                    )
                    if not can:
                        raise RuntimeError(
                            f"GPU {dev} cannot access the memory of rank {p}'s GPU (no peer access)"
                        )
                h = rt.cudaIpcMemHandle_t()
                h.reserved = records[p]["handle"]
                ptr = _check(
                    rt,
                    rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess),
                    f"cudaIpcOpenMemHandle(rank {p})",
                )
                peers[p] = int(ptr)
                if (int(ptr) - int(self._ptr)) % UNIT_BYTES:
                    raise RuntimeError(
                        f"rank {p}'s buffer is mapped at an address not aligned to {UNIT_BYTES} bytes"
                    )
        except Exception as exc:
            error = f"rank {me}: {type(exc).__name__}: {exc}"
        errors = [e for e in self._gather(error) if e]
        if errors:
            self._peers = peers
            self._close_peers(rt)
            self._gather(None)  # every rank has closed its mappings before anyone frees
            self._free_own(rt)
            raise NativeUnavailableError(
                "cannot map the peers' symmetric buffers (native group collectives):\n  "
                + "\n  ".join(errors)
            )
        self._peers = peers
        deltas = [0 if p == me else (peers[p] - int(self._ptr)) // UNIT_BYTES for p in range(W)]
        self.space = SymSpace(
            local=_tensor_over(int(self._ptr), nbytes, self.device),
            deltas=torch.tensor(deltas, dtype=torch.int64, device=self.device),
            rank=me,
        )
        self._calls = 0

    def _close_peers(self, rt) -> None:
        for ptr in self._peers.values():
            try:
                _check(rt, rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")
            except RuntimeError:  # pragma: no cover - nothing useful to do on the way out
                pass
        self._peers = {}

    def _free_own(self, rt) -> None:
        if self._ptr and rt is not None:
            try:
                _check(rt, rt.cudaFree(self._ptr), "cudaFree")
            except RuntimeError:  # pragma: no cover
                pass
        self._ptr = 0
        self.space = None

    def _unmap(self) -> None:
        """Collective: wait for every rank's work, close peer mappings, then free (after a host barrier)."""
        rt = import_cudart()
        # cuda-bindings' runtime keeps its own current device per thread (default 0): set ours first, or a
        # call from another thread (autograd's) would create a context on GPU 0
        _check(rt, rt.cudaSetDevice(self._dev), f"cudaSetDevice({self._dev})")
        torch.cuda.synchronize(self.device)
        self._close_peers(rt)
        self._gather(None)
        self._free_own(rt)

    # ---------------------------------------------------------------------------------- hot path
    @property
    def capacity(self) -> int:
        return 0 if self.space is None else self.space.capacity

    def reserve(self, slot_bytes: int) -> None:
        """Make each of the two staging slots hold ``slot_bytes``; grows (collectively) when needed.

        Every rank passes the same value for the same call (it comes from the plan's largest staging area
        over all ranks and the call's row size), so every rank grows at the same call.
        """
        need = 2 * align_up(slot_bytes)
        if need <= self.capacity:
            return
        size = align_up(max(need, 2 * self.capacity), _GRANULE)
        self._unmap()
        self._map(size)

    def next_slot(self) -> int:
        """Byte offset of the slot of the next call that moves data between ranks.

        Two slots used alternately make one barrier per call enough: a rank writes slot ``k % 2`` only after
        passing call ``k - 1``'s barrier, which every peer reaches only after reading call ``k - 2`` (the
        previous user of that slot) on its stream.
        """
        slot = self._calls % 2
        self._calls += 1
        return self.space.slot_offset(slot)

    def barrier(self) -> None:
        """Stream-ordered barrier on the current stream (call it inside ``torch.cuda.stream(self.stream)``)."""
        dist.all_reduce(self._flag, group=self.group)

    def close(self) -> None:
        """Collective: free this rank's buffer and close its peer mappings (every rank must call it)."""
        if self.space is not None:
            self._unmap()


_BUFFERS: dict[tuple[int, torch.device], tuple[object, NativeBuffer]] = {}


def get_buffer(comm: Comm, device: torch.device) -> NativeBuffer:
    """The buffer of ``(comm.group, device)``, created (collectively) on first use."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    key = (id(comm.group), device)
    entry = _BUFFERS.get(key)
    if entry is None or entry[0] is not comm.group:
        entry = (comm.group, NativeBuffer(comm, device, _initial_bytes()))
        _BUFFERS[key] = entry
    return entry[1]


def _initial_bytes() -> int:
    return env.native_buffer_mb() << 20


def release_buffers() -> None:
    """Free every symmetric buffer of this process (collective over each buffer's group: call it on every
    rank, e.g. before ``destroy_process_group``). The next native call creates a fresh one."""
    for key in list(_BUFFERS):  # creation order: the same on every rank (creation is collective)
        _, buf = _BUFFERS.pop(key)
        buf.close()


__all__ = ["NativeBuffer", "NativeUnavailableError", "SymSpace", "get_buffer", "release_buffers"]
