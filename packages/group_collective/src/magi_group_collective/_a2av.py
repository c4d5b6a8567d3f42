"""The all-to-all-v implementation of the group collectives (chosen in ``_select``)."""

from __future__ import annotations

import torch

from ._comm import Comm
from ._config import ReduceOp
from ._impl import CastRunner, CollectiveImpl, ReduceRunner, a2a, piece_rows
from ._ops import (
    ReduceIndex,
    gather_rows,
    is_identity,
    lse_reduce_rows,
    ranges_index,
    reduce_rows,
    scatter_rows,
)
from ._tables import CastTables, ReduceTables, offsets
from ._work import Work


def _peer_major_rows(per_peer, split_sizes) -> tuple[list[int], list[int], list[int]]:
    """Row starts and sizes of the pieces of every peer, peer-major (a peer's pieces in its order: sends
    destination-major, receives source-major), and the rows per peer (the all-to-all's split sizes)."""
    off = offsets(split_sizes)
    starts, sizes, splits = [], [], []
    for pieces in per_peer:
        st, sz = piece_rows(pieces, off, split_sizes)
        starts += st
        sizes += sz
        splits.append(sum(sz))
    return starts, sizes, splits


class _A2AVCast(CastRunner):
    def __init__(self, tables: CastTables, comm: Comm, device: torch.device):
        self.group = comm.group
        starts, sizes, self.send_splits = _peer_major_rows(tables.sends(), tables.input_split_sizes)
        self.send_idx = ranges_index(starts, sizes, device)
        starts, sizes, self.recv_splits = _peer_major_rows(tables.recvs(), tables.output_split_sizes)
        self.recv_idx = ranges_index(starts, sizes, device)
        # Skip the copy when the layout already is destination-/source-major (no multicast, sorted pieces).
        self.send_identity = is_identity(self.send_idx, sum(tables.input_split_sizes))
        self.recv_identity = is_identity(self.recv_idx, sum(tables.output_split_sizes))

    def run(self, input, output, async_op):
        send = input if self.send_identity and input.is_contiguous() else gather_rows(input, self.send_idx)
        direct = self.recv_identity and output.is_contiguous()
        recv = output if direct else output.new_empty((self.recv_idx.numel(), *output.shape[1:]))
        w = a2a(recv, send, self.recv_splits, self.send_splits, self.group, async_op)
        post = None if direct else (lambda: scatter_rows(output, self.recv_idx, recv))
        if not async_op:
            if post is not None:
                post()
            return Work.completed()
        return Work([w], post, (send, recv))


class _A2AVReduce(ReduceRunner):
    # the all-to-all moves input's dtype; reduce_rows widens each received row into the accumulator
    narrow_input = True

    def __init__(self, tables: ReduceTables, comm: Comm, device: torch.device):
        self.group = comm.group
        starts, sizes, self.send_splits = _peer_major_rows(tables.sends(), tables.input_split_sizes)
        self.send_idx = ranges_index(starts, sizes, device)
        self.send_identity = is_identity(self.send_idx, sum(tables.input_split_sizes))
        recvs = tables.recvs()
        starts, sizes, self.recv_splits = _peer_major_rows(recvs, tables.output_split_sizes)
        scale = [1.0 / len(tables.src_indices[j]) for pieces in recvs for j in pieces]  # AVG: per piece
        self.red = ReduceIndex.build(ranges_index(starts, sizes, torch.device("cpu")), device)
        self.avg_weight = torch.repeat_interleave(
            torch.tensor(scale, dtype=torch.float32), torch.tensor(sizes, dtype=torch.int64)
        ).to(device)

    def run(self, input, output, reduce_op, input_lse, output_lse, async_op, deterministic=False):
        send = input if self.send_identity and input.is_contiguous() else gather_rows(input, self.send_idx)
        recv = input.new_empty((self.red.recv_to_out.numel(), *output.shape[1:]))  # input's dtype
        works = [a2a(recv, send, self.recv_splits, self.send_splits, self.group, async_op)]
        recv_lse = None
        if reduce_op is ReduceOp.LSE:
            send_lse = input_lse if self.send_identity and input_lse.is_contiguous() else None
            if send_lse is None:
                send_lse = gather_rows(input_lse, self.send_idx)
            recv_lse = output_lse.new_empty((self.red.recv_to_out.numel(), *output_lse.shape[1:]))
            works.append(a2a(recv_lse, send_lse, self.recv_splits, self.send_splits, self.group, async_op))

        def post() -> None:
            if reduce_op is ReduceOp.LSE:
                lse_reduce_rows(output, output_lse, recv, recv_lse, self.red, deterministic)
            else:
                weight = self.avg_weight if reduce_op is ReduceOp.AVG else None
                reduce_rows(output, recv, self.red, weight, deterministic)

        if not async_op:
            post()
            return Work.completed()
        return Work(works, post, (send, recv, recv_lse))


class A2AVImpl(CollectiveImpl):
    """Pre-gather (a piece copied once per destination), one ``all_to_all_single``, post-scatter/reduce."""

    def build_cast(self, tables, comm, device, all_tables):
        return _A2AVCast(tables, comm, device)

    def build_reduce(self, tables, comm, device, all_tables):
        return _A2AVReduce(tables, comm, device)
