"""Routing tables of GroupCast / GroupReduce: validation, transposition and routing (pure Python).

Glossary (used in every docstring of this package):

- ``W``: number of ranks of the group; table ranks are group ranks ``0 .. W-1``.
- piece: a run of consecutive tokens (rows along dim 0) of ``input`` or ``output``.
- ``n_in`` / ``n_out``: number of pieces of ``input`` / ``output`` on the calling rank.

Matching rule (the one invariant every rank relies on, checked by debug mode): the pieces that rank
``s`` sends to rank ``r``, taken in the order ``s`` lists them, are exactly the output pieces of ``r``
whose source set contains ``s``, taken in the order ``r`` lists them; their sizes agree pairwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _as_size_tuple(name: str, values: object) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"`{name}` must be a sequence of non-negative ints, got {type(values).__name__}")
    out = []
    for k, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"`{name}[{k}]` must be an int, got {type(v).__name__} ({v!r})")
        if v < 0:
            raise ValueError(f"`{name}[{k}]` must be >= 0, got {v}")
        out.append(int(v))
    return tuple(out)


def _as_rank(name: str, v: object, world_size: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"`{name}` must be an int rank, got {type(v).__name__} ({v!r})")
    if not 0 <= v < world_size:
        raise ValueError(f"`{name}` = {v} is out of range: ranks of this group are 0..{world_size - 1}")
    return int(v)


def _as_rank_set(name: str, values: object, world_size: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"`{name}` must be a list of ranks, got {type(values).__name__} ({values!r})")
    ranks = tuple(_as_rank(f"{name}[{k}]", v, world_size) for k, v in enumerate(values))
    if len(set(ranks)) != len(ranks):
        raise ValueError(
            f"`{name}` = {list(ranks)} lists a rank twice; each destination/source must be unique"
        )
    return ranks


def _check_world(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size` must be a positive int, got {world_size!r}")


def _ranks_per_piece(
    name: str, values: object, world_size: int, *, pieces: str, n_pieces: int, role: str, many: bool
) -> tuple:
    """One rank (``many`` False) or one list of unique ranks (``many`` True) per piece of ``pieces``."""
    kind = "rank lists" if many else "ranks"
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"`{name}` must be a list of {kind}, got {type(values).__name__}")
    if len(values) != n_pieces:
        side = pieces.split("_")[0]  # "input" / "output"
        raise ValueError(
            f"`{name}` has {len(values)} entries but `{pieces}` has {n_pieces} pieces; "
            f"give one {role} {'list' if many else 'rank'} per {side} piece"
        )
    check = _as_rank_set if many else _as_rank
    return tuple(check(f"{name}[{k}]", v, world_size) for k, v in enumerate(values))


def _validated(input_split_sizes, output_split_sizes, dst, src, world_size: int, *, cast: bool) -> tuple:
    """The fields of validated tables, for both collectives: GroupCast sends an input piece to a list of ranks
    and receives an output piece from one; GroupReduce sends to one rank and reduces from a list."""
    _check_world(world_size)
    ins = _as_size_tuple("input_split_sizes", input_split_sizes)
    outs = _as_size_tuple("output_split_sizes", output_split_sizes)
    dst_name, src_name = ("dst_indices", "src_index") if cast else ("dst_index", "src_indices")
    dst_t = _ranks_per_piece(
        dst_name,
        dst,
        world_size,
        pieces="input_split_sizes",
        n_pieces=len(ins),
        role="destination",
        many=cast,
    )
    src_t = _ranks_per_piece(
        src_name,
        src,
        world_size,
        pieces="output_split_sizes",
        n_pieces=len(outs),
        role="source",
        many=not cast,
    )
    return ins, outs, dst_t, src_t, world_size


@dataclass(frozen=True, slots=True)
class CastTables:
    """Validated GroupCast tables of one rank.

    Attributes:
        input_split_sizes: ``n_in`` token counts cutting ``input`` along dim 0.
        output_split_sizes: ``n_out`` token counts cutting ``output`` along dim 0.
        dst_indices: for each input piece, the ranks it is sent to (unique, possibly empty).
        src_index: for each output piece, the rank it comes from.
        world_size: ``W``.
    """

    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    dst_indices: tuple[tuple[int, ...], ...]
    src_index: tuple[int, ...]
    world_size: int

    @staticmethod
    def build(input_split_sizes, output_split_sizes, dst_indices, src_index, world_size: int) -> CastTables:
        """Validate raw tables (lists) and return them as tuples; raises ValueError/TypeError."""
        return CastTables(
            *_validated(input_split_sizes, output_split_sizes, dst_indices, src_index, world_size, cast=True)
        )

    def transpose(self) -> ReduceTables:
        """The GroupReduce tables that move data back along the same routes."""
        return ReduceTables(
            input_split_sizes=self.output_split_sizes,
            output_split_sizes=self.input_split_sizes,
            dst_index=self.src_index,
            src_indices=self.dst_indices,
            world_size=self.world_size,
        )

    def sends(self) -> list[list[int]]:
        """``sends()[d]``: input piece ids sent to rank ``d``, in piece order."""
        out: list[list[int]] = [[] for _ in range(self.world_size)]
        for i, ds in enumerate(self.dst_indices):
            for d in ds:
                out[d].append(i)
        return out

    def recvs(self) -> list[list[int]]:
        """``recvs()[s]``: output piece ids received from rank ``s``, in piece order."""
        out: list[list[int]] = [[] for _ in range(self.world_size)]
        for j, s in enumerate(self.src_index):
            out[s].append(j)
        return out


@dataclass(frozen=True, slots=True)
class ReduceTables:
    """Validated GroupReduce tables of one rank.

    Attributes:
        input_split_sizes: ``n_in`` token counts cutting ``input`` along dim 0.
        output_split_sizes: ``n_out`` token counts cutting ``output`` along dim 0.
        dst_index: for each input piece, the single rank it is sent to.
        src_indices: for each output piece, the ranks whose pieces are reduced into it (unique,
            possibly empty: the output piece is then left as is).
        world_size: ``W``.
    """

    input_split_sizes: tuple[int, ...]
    output_split_sizes: tuple[int, ...]
    dst_index: tuple[int, ...]
    src_indices: tuple[tuple[int, ...], ...]
    world_size: int

    @staticmethod
    def build(input_split_sizes, output_split_sizes, dst_index, src_indices, world_size: int) -> ReduceTables:
        """Validate raw tables (lists) and return them as tuples; raises ValueError/TypeError."""
        return ReduceTables(
            *_validated(input_split_sizes, output_split_sizes, dst_index, src_indices, world_size, cast=False)
        )

    def transpose(self) -> CastTables:
        """The GroupCast tables that move data back along the same routes."""
        return CastTables(
            input_split_sizes=self.output_split_sizes,
            output_split_sizes=self.input_split_sizes,
            dst_indices=self.src_indices,
            src_index=self.dst_index,
            world_size=self.world_size,
        )

    def sends(self) -> list[list[int]]:
        """``sends()[d]``: input piece ids sent to rank ``d``, in piece order."""
        out: list[list[int]] = [[] for _ in range(self.world_size)]
        for i, d in enumerate(self.dst_index):
            out[d].append(i)
        return out

    def recvs(self) -> list[list[int]]:
        """``recvs()[s]``: output piece ids that receive a contribution from rank ``s``, in order."""
        out: list[list[int]] = [[] for _ in range(self.world_size)]
        for j, ss in enumerate(self.src_indices):
            for s in ss:
                out[s].append(j)
        return out


def offsets(sizes: Sequence[int]) -> list[int]:
    """Exclusive prefix sum: start row of every piece."""
    out, acc = [], 0
    for n in sizes:
        out.append(acc)
        acc += n
    return out


def cross_check(tables: Sequence[CastTables | ReduceTables]) -> list[str]:
    """Check the matching rule over the tables of all ranks (index = rank); return the problems found.

    Each problem names the (sender, receiver) pair and what differs; an empty list means consistent.
    """
    problems: list[str] = []
    kinds = {type(t).__name__ for t in tables}
    if len(kinds) != 1:
        return [f"ranks called different collectives: {sorted(kinds)}"]
    W = len(tables)
    for r, t in enumerate(tables):
        if t.world_size != W:
            problems.append(f"rank {r} validated its tables for world_size {t.world_size}, group has {W}")
    if problems:
        return problems
    sends = [t.sends() for t in tables]
    recvs = [t.recvs() for t in tables]
    for s in range(W):
        for r in range(W):
            sent = [tables[s].input_split_sizes[i] for i in sends[s][r]]
            got = [tables[r].output_split_sizes[j] for j in recvs[r][s]]
            if sent != got:
                problems.append(
                    f"(sender {s}, receiver {r}): sender {s} sends pieces of sizes {sent} "
                    f"(its input pieces {sends[s][r]}), receiver {r} expects sizes {got} "
                    f"(its output pieces {recvs[r][s]})"
                )
    return problems
