"""GroupCast / GroupReduce arguments of one stage, and how to derive them from what each rank needs.

GroupCast semantics (`magi_group_collective.group_cast`): a rank's input (its local K or V, `[local_tokens,
...]`) is split into pieces of `input_split_sizes`; piece i goes to every rank in `dst_indices[i]` (possibly
none). Its output (the stage's recv buffer) is split into `output_split_sizes`; piece j comes from rank
`src_index[j]`, and pieces from one source arrive in the order that source lists them. GroupReduce is the
exact transpose: partial dK/dV of the recv buffer go back to their owners and are summed into local dK/dV.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GroupCastArgs", "GroupReduceArgs", "build_cast_args"]


@dataclass(frozen=True, slots=True)
class GroupCastArgs:
    """One rank's arguments to `group_cast` for one stage.

    Attributes:
        input_split_sizes: sums to the rank's local token count (the input is local K or V).
        output_split_sizes: sums to this stage's remote-token count (the output is the recv buffer).
        dst_indices: per input piece, the sorted ranks it goes to (may be empty).
        src_index: per output piece, the rank that sends it.
    """

    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    dst_indices: tuple[tuple[int, ...], ...]
    src_index: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.dst_indices) != len(self.input_split_sizes):
            raise ValueError("GroupCastArgs: one dst_indices entry per input piece")
        if len(self.src_index) != len(self.output_split_sizes):
            raise ValueError("GroupCastArgs: one src_index entry per output piece")

    def transpose(self) -> GroupReduceArgs:
        """The GroupReduce that sends the recv buffer's partial gradients back (input <-> output)."""
        return GroupReduceArgs(
            input_split_sizes=self.output_split_sizes,
            output_split_sizes=self.input_split_sizes,
            dst_index=self.src_index,
            src_indices=self.dst_indices,
        )


@dataclass(frozen=True, slots=True)
class GroupReduceArgs:
    """One rank's arguments to `group_reduce` for one stage (the transpose of its `GroupCastArgs`).

    Attributes:
        input_split_sizes: pieces of the partial dK/dV of the recv buffer (sums to the stage's remote tokens).
        output_split_sizes: pieces of the local dK/dV (sums to the local token count).
        dst_index: per input piece, the owner it is reduced into.
        src_indices: per output piece, the sorted ranks whose partials are summed into it.
    """

    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    dst_index: tuple[int, ...]
    src_indices: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.dst_index) != len(self.input_split_sizes):
            raise ValueError("GroupReduceArgs: one dst_index entry per input piece")
        if len(self.src_indices) != len(self.output_split_sizes):
            raise ValueError("GroupReduceArgs: one src_indices entry per output piece")

    def transpose(self) -> GroupCastArgs:
        return GroupCastArgs(
            input_split_sizes=self.output_split_sizes,
            output_split_sizes=self.input_split_sizes,
            dst_indices=self.src_indices,
            src_index=self.dst_index,
        )


def build_cast_args(
    wants: Sequence[Sequence[Sequence[tuple[int, int]]]], local_seqlen: int | Sequence[int]
) -> list[GroupCastArgs]:
    """GroupCast args of every rank for one stage.

    `wants[dst][src]` lists the intervals `[s, e)` of `src`'s local tokens that `dst` receives, sorted and
    disjoint, in the order they sit in `dst`'s recv buffer (sources in rank order, each in its local order).
    Each sender's local tokens are cut at every interval boundary; a piece goes to every rank whose
    intervals cover it, so one output piece of a receiver is exactly one input piece of its source.
    `local_seqlen`: the local token count of every rank (one int), or of each rank (uneven shards).
    """
    cp = len(wants)
    local = [local_seqlen] * cp if isinstance(local_seqlen, int) else list(local_seqlen)
    # per sender: (position, +1/-1, dst) events over its local tokens
    events: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    for dst in range(cp):
        for src in range(cp):
            for s, e in wants[dst][src]:
                events[src].append((s, 1, dst))
                events[src].append((e, -1, dst))
    # per receiver, per source: the sizes of the source's pieces it gets, in the source's order
    recv: list[list[list[int]]] = [[[] for _ in range(cp)] for _ in range(cp)]
    inputs: list[tuple[list[int], list[tuple[int, ...]]]] = []
    for src in range(cp):
        bounds = sorted({0, local[src], *(p for p, _, _ in events[src])})
        by_pos: dict[int, list[tuple[int, int]]] = {}
        for p, d, dst in events[src]:
            by_pos.setdefault(p, []).append((d, dst))
        active: dict[int, int] = {}
        sizes: list[int] = []
        dsts: list[tuple[int, ...]] = []
        for a, b in itertools.pairwise(bounds):
            for d, dst in by_pos.get(a, ()):
                active[dst] = active.get(dst, 0) + d
                if active[dst] == 0:
                    del active[dst]
            group = tuple(sorted(active))
            sizes.append(b - a)
            dsts.append(group)
            for dst in group:
                recv[dst][src].append(b - a)
        inputs.append((sizes, dsts))
    out = []
    for r in range(cp):
        out_sizes = [n for src in range(cp) for n in recv[r][src]]
        src_index = [src for src in range(cp) for _ in recv[r][src]]
        out.append(
            GroupCastArgs(
                input_split_sizes=tuple(inputs[r][0]),
                output_split_sizes=tuple(out_sizes),
                dst_indices=tuple(inputs[r][1]),
                src_index=tuple(src_index),
            )
        )
    return out
