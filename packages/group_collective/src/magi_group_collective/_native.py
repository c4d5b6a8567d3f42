"""The native implementation of GroupCast / GroupReduce: symmetric memory inside one node.

Per call (both collectives), on the buffer's communication stream, after it has waited for the caller's
stream:

1. stage: copy the input pieces other ranks need into this rank's symmetric buffer (each piece once, in
   one of two slots used alternately; pieces a rank sends to itself are read from ``input`` directly);
2. barrier: one stream-ordered NCCL ``all_reduce`` of an int32 (every rank has staged);
3. pull: one kernel reads every output row from its owner's slot straight into its place (GroupCast), or
   reduces every output row's contributions in fp32 in increasing source rank (GroupReduce sum / avg / lse).

So a piece crosses NVLink once per destination rank and lands in its final place; there is no receive
buffer and no scatter. Two slots make one barrier per call enough (see ``NativeBuffer.next_slot``). A call
in which no rank reads another rank's data (only self-sends) is a local copy with no barrier, decided from
the tables of every rank, so alike everywhere. ``async_op=True`` returns a :class:`Work` whose ``wait()``
makes the caller's stream wait for the communication stream (the host never blocks).

Requirements, checked before any communication where a rank can tell alone (CUDA device, NCCL group, one
node of a 2-D mesh, cuda-bindings importable) and collectively, with the same error on every rank, when the
buffers are set up (ranks on one host, one GPU each, peer access, IPC mapping): see ``_symmetric``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._comm import Comm
from ._config import ReduceOp
from ._impl import CastRunner, CollectiveImpl, ReduceRunner
from ._native_plan import (
    UNIT_BYTES,
    NativeCastLayout,
    NativeReduceLayout,
    SlotLayout,
    cast_layout,
    reduce_layout,
)
from ._symmetric import NativeUnavailableError, SymSpace, native_requirements
from ._work import Work


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def _slot_view(space: SymSpace, offset: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """``[n, C]`` rows of ``like``'s dtype at byte ``offset`` of this rank's buffer."""
    C = math.prod(like.shape[1:])
    nbytes = n * C * like.element_size()
    return space.local[offset : offset + nbytes].view(like.dtype).view(n, C)


def check_native_usable(comm: Comm, device: torch.device, selected_by: str) -> None:
    """Raise NativeUnavailableError where this rank alone can tell native cannot run (no communication).

    The checks depend only on the plan's device, the group and the installation, so they agree on every
    rank of a sane job; the rest is checked collectively when the buffers are set up.
    """
    why = None
    if device.type != "cuda":
        why = f"the plan's tensors are on {device}, not a CUDA device"
    elif not torch.cuda.is_available():
        why = "CUDA is not available in this process"
    elif comm.world_size > 1:
        backend = str(dist.get_backend(comm.group)).lower()
        if "nccl" not in backend:
            why = f"the process group's backend is {backend!r}, not NCCL"
        elif comm.mesh_shape is not None and comm.mesh_shape[0] > 1:
            why = (
                f"the 2-D DeviceMesh has {comm.mesh_shape[0]} nodes; native is intra-node only "
                "(use impl='hierarchical' across nodes)"
            )
        else:
            try:
                from ._symmetric import import_cudart

                import_cudart()
            except NativeUnavailableError as exc:
                why = str(exc)
    if why is not None:
        raise NativeUnavailableError(
            f"group collective impl 'native' (selected by {selected_by}) cannot run: {why}. "
            f"{native_requirements()}. Use impl='a2av' (any backend) or 'hierarchical' (2-D mesh) instead."
        )


class _Call:
    """One call's stream bookkeeping: the comm stream waits for the caller; ``finish`` hands back."""

    def __init__(self, buffer, tensors: Sequence[torch.Tensor]):
        self.buffer = buffer
        self.caller = torch.cuda.current_stream(buffer.device)
        buffer.stream.wait_stream(self.caller)
        self.tensors = [t for t in tensors if t is not None]

    def finish(self, async_op: bool, post=None) -> Work:
        stream = self.buffer.stream
        if not async_op:
            self.caller.wait_stream(stream)
            if post is not None:
                post()
            return Work.completed()
        for t in self.tensors:  # allocated on the caller's stream, used on the comm stream
            t.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        return Work([_StreamWait(event, self.buffer.device)], post, self.tensors)


class _StreamWait:
    """``wait()``: the current stream waits for the recorded event (no host synchronisation)."""

    __slots__ = ("device", "event")

    def __init__(self, event, device):
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class NativeCast(CastRunner):
    """One rank's native GroupCast (the tables of every rank are needed: see ``_native_plan``)."""

    def __init__(self, layout: NativeCastLayout, rank: int, device: torch.device, buffer=None):
        self.layout, self.rank, self.buffer = layout, rank, buffer
        self.stage_rows = layout.stage_rows.to(device)
        self.src_rank = layout.src_rank.to(device)
        self.src_row = layout.src_row.to(device)

    def slot_bytes(self, input: torch.Tensor) -> int:
        return SlotLayout.of(
            self.layout.max_stage_rows, math.prod(input.shape[1:]) * input.element_size()
        ).total

    def stage(self, input: torch.Tensor, space: SymSpace, slot: int) -> None:
        """Copy this rank's pieces for other ranks into its staging slot at byte ``slot``."""
        from ._triton_kernels import copy_rows

        n = self.stage_rows.numel()
        if n:
            copy_rows(_rows(input), _slot_view(space, slot, n, input), src_idx=self.stage_rows, dst_idx=None)

    def pull(self, input: torch.Tensor, output: torch.Tensor, space: SymSpace, slot: int) -> None:
        """Fill every output row from its owner's slot (or from ``input`` for this rank's own pieces)."""
        from ._native_kernels import pull_rows

        pull_rows(space, slot, _rows(input), _rows(output), self.src_rank, self.src_row)

    def run(self, input, output, async_op):
        x = input.contiguous()
        out = (
            output
            if output.is_contiguous()
            else torch.empty_like(output, memory_format=torch.contiguous_format)
        )
        buf = self.buffer
        if buf is None or not self.layout.remote:  # only self-sends on every rank: a local copy, no barrier
            self.pull(x, out, _LocalSpace.of(x, self.rank), 0)
            if out is not output:
                output.copy_(out)
            return Work.completed()
        buf.reserve(self.slot_bytes(x))
        call = _Call(buf, (x, out))
        with torch.cuda.stream(buf.stream):
            slot = buf.next_slot()
            self.stage(x, buf.space, slot)
            buf.barrier()
            self.pull(x, out, buf.space, slot)
        post = None if out is output else (lambda: output.copy_(out))
        return call.finish(async_op, post)


class NativeReduce(ReduceRunner):
    """One rank's native GroupReduce.

    ``narrow_input`` stays False (the plan widens a narrower input first): the pull kernels address every
    rank's staged rows through one view of the symmetric buffer in ``output``'s dtype, so reading narrow rows
    would need the kernels and the slot layout to carry a second element size.
    """

    def __init__(self, layout: NativeReduceLayout, rank: int, device: torch.device, buffer=None):
        self.layout, self.rank, self.buffer = layout, rank, buffer
        self.stage_rows = layout.stage_rows.to(device)
        self.touched = layout.touched.to(device)
        self.ptr = layout.ptr.to(device)
        self.c_src = layout.c_src.to(device)
        self.c_row = layout.c_row.to(device)
        self.csr = (self.touched, self.ptr, self.c_src, self.c_row)  # the pull kernels' reduction order
        self.avg_weight = layout.avg_weight.to(device)

    def slot_layout(self, input: torch.Tensor, input_lse: torch.Tensor | None) -> SlotLayout:
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        lse_row = 0 if input_lse is None else math.prod(input_lse.shape[1:]) * 4
        return SlotLayout.of(self.layout.max_stage_rows, row_bytes, lse_row)

    def stage(self, input, input_lse, space: SymSpace, slot: int) -> None:
        from ._triton_kernels import copy_rows

        n = self.stage_rows.numel()
        if not n:
            return
        copy_rows(_rows(input), _slot_view(space, slot, n, input), src_idx=self.stage_rows, dst_idx=None)
        if input_lse is not None:
            off = slot + self.slot_layout(input, input_lse).lse_offset
            copy_rows(
                _rows(input_lse), _slot_view(space, off, n, input_lse), src_idx=self.stage_rows, dst_idx=None
            )

    def pull(self, input, output, reduce_op, input_lse, output_lse, space: SymSpace, slot: int) -> None:
        from ._native_kernels import pull_lse_reduce, pull_reduce

        if reduce_op is ReduceOp.LSE:
            H, D = input_lse.shape[1], math.prod(input.shape[2:])
            lse_slot = slot + self.slot_layout(input, input_lse).lse_offset
            pull_lse_reduce(
                space, slot, lse_slot, input.reshape(input.shape[0], H, D), input_lse,
                output.reshape(output.shape[0], H, D), output_lse, self.csr,
            )  # fmt: skip
        else:
            weight = self.avg_weight if reduce_op is ReduceOp.AVG else None
            pull_reduce(space, slot, _rows(input), _rows(output), self.csr, weight)

    def run(self, input, output, reduce_op, input_lse, output_lse, async_op, deterministic=False):
        # the native reduction's Triton kernels add every row's sources in a fixed order always
        lse = reduce_op is ReduceOp.LSE
        x = input.contiguous()
        x_lse = input_lse.contiguous() if lse else None
        out = output if output.is_contiguous() else output.contiguous()
        out_lse = None
        if lse:
            out_lse = output_lse if output_lse.is_contiguous() else output_lse.contiguous()

        def copy_back() -> None:
            if out is not output:
                output.copy_(out)
            if lse and out_lse is not output_lse:
                output_lse.copy_(out_lse)

        buf = self.buffer
        if buf is None or not self.layout.remote:  # only self-sends on every rank: no barrier
            self.pull(x, out, reduce_op, x_lse, out_lse, _LocalSpace.of(x, self.rank), 0)
            copy_back()
            return Work.completed()
        buf.reserve(self.slot_layout(x, x_lse).total)
        call = _Call(buf, (x, out, x_lse, out_lse))
        with torch.cuda.stream(buf.stream):
            slot = buf.next_slot()
            self.stage(x, x_lse, buf.space, slot)
            buf.barrier()
            self.pull(x, out, reduce_op, x_lse, out_lse, buf.space, slot)
        needs_copy = out is not output or (lse and out_lse is not output_lse)
        return call.finish(async_op, copy_back if needs_copy else None)


class _LocalSpace:
    """A stand-in space for calls where every row comes from this rank's own ``input`` (``src == rank``
    everywhere, so only its address matters)."""

    @staticmethod
    def of(x: torch.Tensor, rank: int = 0) -> SymSpace:
        local = torch.empty(UNIT_BYTES, dtype=torch.uint8, device=x.device)
        return SymSpace(
            local=local, deltas=torch.zeros(rank + 1, dtype=torch.int64, device=x.device), rank=rank
        )


class NativeImpl(CollectiveImpl):
    """Symmetric-memory GroupCast / GroupReduce inside one node (CUDA IPC buffers, Triton pull kernels)."""

    needs_all_tables = True

    def check_usable(self, comm: Comm, device: torch.device, selected_by: str) -> None:
        check_native_usable(comm, device, selected_by)

    @staticmethod
    def _buffer(comm: Comm, device: torch.device):
        if comm.world_size == 1:
            return None
        from ._symmetric import get_buffer

        return get_buffer(comm, device)

    # the signatures and types are CollectiveImpl's (as in the a2av and hierarchical implementations)
    def build_cast(self, tables, comm, device, all_tables):
        layout = cast_layout(all_tables if all_tables is not None else [tables], comm.rank)
        return NativeCast(layout, comm.rank, device, self._buffer(comm, device))

    def build_reduce(self, tables, comm, device, all_tables):
        layout = reduce_layout(all_tables if all_tables is not None else [tables], comm.rank)
        return NativeReduce(layout, comm.rank, device, self._buffer(comm, device))
