"""Hierarchical GroupCast / GroupReduce over a 2-D DeviceMesh ``(inter, intra)``.

Table rank ``p`` sits at node ``p // L``, local index ``p % L`` (``N`` nodes of ``L`` ranks).

GroupCast, two all-to-all-v stages:
  1. inter (ranks with the same local index): a piece goes once to each *remote node* that holds one
     of its destinations, to the peer with the sender's local index there;
  2. intra (the ranks of one node): every rank sends its own pieces to their local destinations and
     forwards what arrived in stage 1 to theirs.
GroupReduce mirrors it: 1. intra: each piece goes to the rank of the source's node that has the
destination's local index, which pre-reduces all contributions of its node to one output piece;
2. inter: one pre-reduced piece per (destination piece, source node) crosses to the destination, which
does the final reduction. So a piece crosses the inter-node link once per destination node.

Routing through an intermediate rank depends on the tables of other ranks, so the plan gathers all
tables once at construction (collective) and checks them for consistency on every rank alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._comm import Comm
from ._config import ReduceOp
from ._impl import CastRunner, CollectiveImpl, ReduceRunner, a2a, chain, piece_rows
from ._ops import (
    ReduceIndex,
    gather_rows,
    lse_reduce_rows,
    move_rows,
    ranges_index,
    reduce_rows,
    scatter_rows,
)
from ._tables import CastTables, ReduceTables, cross_check, offsets
from ._work import Work

_CPU = torch.device("cpu")


def _check(all_tables: Sequence) -> None:
    problems = cross_check(all_tables)
    if problems:
        raise ValueError("group collective tables are inconsistent across ranks:\n  " + "\n  ".join(problems))


class _Layout:
    """Rows of a staged buffer, appended segment by segment (pure bookkeeping, host side)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self.total = 0

    def add(self, start: int, size: int) -> int:
        self.starts.append(start)
        self.sizes.append(size)
        self.total += size
        return self.total - size


def _split_sums(per_peer: list[list[int]]) -> list[int]:
    return [sum(x) for x in per_peer]


class _HierCast(CastRunner):
    def __init__(self, tables: CastTables, comm: Comm, device: torch.device, all_t: Sequence[CastTables]):
        _check(all_t)
        N, L = comm.mesh_shape
        g = comm.rank
        n = g // L
        self.inter, self.intra, self.device = comm.inter_group, comm.intra_group, device

        def remote_nodes(s: int, i: int) -> set[int]:
            return {d // L for d in all_t[s].dst_indices[i]} - {s // L}

        def b1_segments(m: int) -> list[tuple[int, int]]:
            """(source, piece) arriving at rank m in stage 1, in m's buffer order."""
            mn, ml = divmod(m, L)
            return [
                (nn * L + ml, i)
                for nn in range(N)
                if nn != mn
                for i in range(len(all_t[nn * L + ml].input_split_sizes))
                if mn in remote_nodes(nn * L + ml, i)
            ]

        # Stage 1 (inter): my pieces, once per remote destination node.
        in_off = offsets(tables.input_split_sizes)
        send1, s1_splits = _Layout(), []
        for nn in range(N):
            pieces = [i for i in range(len(tables.input_split_sizes)) if nn in remote_nodes(g, i)]
            for i in pieces:
                send1.add(in_off[i], tables.input_split_sizes[i])
            s1_splits.append(sum(tables.input_split_sizes[i] for i in pieces))
        b1 = b1_segments(g)
        b1_off, r1_splits = {}, [0] * N
        pos = 0
        for s, i in b1:
            size = all_t[s].input_split_sizes[i]
            b1_off[(s, i)] = pos
            pos += size
            r1_splits[s // L] += size
        self.send1_idx = ranges_index(send1.starts, send1.sizes, device)
        self.s1_splits, self.r1_splits, self.b1_rows = s1_splits, r1_splits, pos

        # Stage 2 (intra): to each local rank d, my own pieces for d, then forwarded pieces for d.
        own_pos, own_src, fwd_pos, fwd_src = _Layout(), _Layout(), _Layout(), _Layout()
        s2_splits, cursor = [], 0
        for ll in range(L):
            d = n * L + ll
            start = cursor
            for i, ds in enumerate(tables.dst_indices):
                if d in ds:
                    size = tables.input_split_sizes[i]
                    own_pos.add(cursor, size)
                    own_src.add(in_off[i], size)
                    cursor += size
            for s, i in b1:
                if d in all_t[s].dst_indices[i]:
                    size = all_t[s].input_split_sizes[i]
                    fwd_pos.add(cursor, size)
                    fwd_src.add(b1_off[(s, i)], size)
                    cursor += size
            s2_splits.append(cursor - start)
        self.own_pos = ranges_index(own_pos.starts, own_pos.sizes, device)
        self.own_src = ranges_index(own_src.starts, own_src.sizes, device)
        self.fwd_pos = ranges_index(fwd_pos.starts, fwd_pos.sizes, device)
        self.fwd_src = ranges_index(fwd_src.starts, fwd_src.sizes, device)
        self.s2_rows, self.s2_splits = cursor, s2_splits

        # Receive side of stage 2: segments from each local rank m, mapped to my output pieces.
        sent_to_me = {
            s: [i for i, ds in enumerate(all_t[s].dst_indices) if g in ds] for s in range(len(all_t))
        }
        recvs = tables.recvs()
        match = {(s, i): j for s in sent_to_me for i, j in zip(sent_to_me[s], recvs[s])}
        out_off = offsets(tables.output_split_sizes)
        recv, r2_splits = _Layout(), []
        for ll in range(L):
            m = n * L + ll
            segs = [(m, i) for i, ds in enumerate(all_t[m].dst_indices) if g in ds]
            segs += [(s, i) for s, i in b1_segments(m) if g in all_t[s].dst_indices[i]]
            before = recv.total
            for key in segs:
                j = match[key]
                recv.add(out_off[j], tables.output_split_sizes[j])
            r2_splits.append(recv.total - before)
        self.recv_idx = ranges_index(recv.starts, recv.sizes, device)
        self.r2_splits = r2_splits

    def run(self, input, output, async_op):
        trailing = output.shape[1:]
        send1 = gather_rows(input, self.send1_idx)
        b1 = output.new_empty((self.b1_rows, *trailing))
        w1 = a2a(b1, send1, self.r1_splits, self.s1_splits, self.inter, True)

        def stage2() -> Work:
            send2 = output.new_empty((self.s2_rows, *trailing))
            move_rows(input, self.own_src, send2, self.own_pos)
            move_rows(b1, self.fwd_src, send2, self.fwd_pos)
            recv = output.new_empty((self.recv_idx.numel(), *trailing))
            w2 = a2a(recv, send2, self.r2_splits, self.s2_splits, self.intra, True)
            return Work([w2], lambda: scatter_rows(output, self.recv_idx, recv), (send2, recv, b1, send1))

        return chain(w1, stage2, self.device, async_op)


class _HierReduce(ReduceRunner):
    # stage 1 moves input's dtype and the pre-reduction widens it exactly into the partial sums P; stage 2
    # moves P, in output's dtype (it holds sums)
    narrow_input = True

    def __init__(self, tables: ReduceTables, comm: Comm, device: torch.device, all_t: Sequence[ReduceTables]):
        _check(all_t)
        N, L = comm.mesh_shape
        g = comm.rank
        n, l = divmod(g, L)
        W = N * L
        self.inter, self.intra, self.device = comm.inter_group, comm.intra_group, device
        # match[(s, i)] = output piece of dst_index[i] that piece i of rank s is reduced into.
        match: dict[tuple[int, int], int] = {}
        for d in range(W):
            recvs = all_t[d].recvs()
            for s in range(W):
                for i, j in zip([i for i, dd in enumerate(all_t[s].dst_index) if dd == d], recvs[s]):
                    match[(s, i)] = j

        # Stage 1 (intra): piece i goes to the rank of my node with the destination's local index.
        in_off = offsets(tables.input_split_sizes)
        send1, s1_splits = _Layout(), []
        for ll in range(L):
            pieces = [i for i, d in enumerate(tables.dst_index) if d % L == ll]
            st, sz = piece_rows(pieces, in_off, tables.input_split_sizes)
            for a, b in zip(st, sz):
                send1.add(a, b)
            s1_splits.append(sum(sz))
        self.send1_idx = ranges_index(send1.starts, send1.sizes, device)
        self.s1_splits = s1_splits

        # Partial buffer P: per destination node, per output piece of my counterpart there that has a
        # source in my node, one pre-reduced segment (ordered by node: the stage-2 send layout).
        p_off, p_rows, s2_splits = {}, 0, []
        for nn in range(N):
            d = nn * L + l
            start = p_rows
            for j, srcs in enumerate(all_t[d].src_indices):
                if any(s // L == n for s in srcs):
                    p_off[(d, j)] = p_rows
                    p_rows += all_t[d].output_split_sizes[j]
            s2_splits.append(p_rows - start)
        self.p_rows, self.s2_splits = p_rows, s2_splits

        # Receive side of stage 1 and the pre-reduction B1 -> P.
        b1_to_p, r1_splits, weights, sizes = _Layout(), [], [], []
        for ll in range(L):
            s = n * L + ll
            before = b1_to_p.total
            for i, d in enumerate(all_t[s].dst_index):
                if d % L == l:
                    j, size = match[(s, i)], all_t[s].input_split_sizes[i]
                    b1_to_p.add(p_off[(d, j)], size)
                    weights.append(1.0 / len(all_t[d].src_indices[j]))
                    sizes.append(size)
            r1_splits.append(b1_to_p.total - before)
        self.r1_splits = r1_splits
        self.pre = ReduceIndex.build(ranges_index(b1_to_p.starts, b1_to_p.sizes, _CPU), device)
        self.avg_weight = torch.repeat_interleave(
            torch.tensor(weights, dtype=torch.float32), torch.tensor(sizes, dtype=torch.int64)
        ).to(device)

        # Receive side of stage 2: from the counterpart in each node, my pieces with a source there.
        out_off = offsets(tables.output_split_sizes)
        recv, r2_splits = _Layout(), []
        for nn in range(N):
            before = recv.total
            for j, srcs in enumerate(tables.src_indices):
                if any(s // L == nn for s in srcs):
                    recv.add(out_off[j], tables.output_split_sizes[j])
            r2_splits.append(recv.total - before)
        self.r2_splits = r2_splits
        self.final = ReduceIndex.build(ranges_index(recv.starts, recv.sizes, _CPU), device)

    def run(self, input, output, reduce_op, input_lse, output_lse, async_op, deterministic=False):
        trailing = output.shape[1:]
        lse = reduce_op is ReduceOp.LSE
        send1 = gather_rows(input, self.send1_idx)
        b1 = input.new_empty((self.pre.recv_to_out.numel(), *trailing))
        works = [a2a(b1, send1, self.r1_splits, self.s1_splits, self.intra, True)]
        if lse:
            send1_lse = gather_rows(input_lse, self.send1_idx)
            b1_lse = output_lse.new_empty((b1.shape[0], *output_lse.shape[1:]))
            works.append(a2a(b1_lse, send1_lse, self.r1_splits, self.s1_splits, self.intra, True))
        first = Work(works)

        def stage2() -> Work:
            p = output.new_zeros((self.p_rows, *trailing))
            if lse:
                p_lse = output_lse.new_full((self.p_rows, *output_lse.shape[1:]), float("-inf"))
                lse_reduce_rows(p, p_lse, b1, b1_lse, self.pre, deterministic)
            else:
                weight = self.avg_weight if reduce_op is ReduceOp.AVG else None
                reduce_rows(p, b1, self.pre, weight, deterministic)
            recv = output.new_empty((self.final.recv_to_out.numel(), *trailing))
            ws = [a2a(recv, p, self.r2_splits, self.s2_splits, self.inter, True)]
            recv_lse = None
            if lse:
                recv_lse = output_lse.new_empty((recv.shape[0], *output_lse.shape[1:]))
                ws.append(a2a(recv_lse, p_lse, self.r2_splits, self.s2_splits, self.inter, True))

            def post() -> None:
                if lse:
                    lse_reduce_rows(output, output_lse, recv, recv_lse, self.final, deterministic)
                else:  # avg weights were applied in the pre-reduction
                    reduce_rows(output, recv, self.final, None, deterministic)

            return Work(ws, post, (p, recv, recv_lse))

        return chain(first, stage2, self.device, async_op)


class HierarchicalImpl(CollectiveImpl):
    """Two-stage all-to-all-v over a 2-D ``(inter, intra)`` DeviceMesh."""

    needs_all_tables = True

    def build_cast(self, tables, comm, device, all_tables):
        return _HierCast(tables, comm, device, all_tables)

    def build_reduce(self, tables, comm, device, all_tables):
        return _HierReduce(tables, comm, device, all_tables)
