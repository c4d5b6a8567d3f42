"""GroupCastPlan / GroupReducePlan: validate tables once, precompute index tensors, run the collective."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._comm import Comm, default_device, resolve_comm
from ._config import GroupCollectiveImpl, ReduceOp, env_debug, parse_reduce_op
from ._impl import CastRunner, ReduceRunner
from ._select import choose_impl, implementation
from ._tables import CastTables, ReduceTables, cross_check
from ._work import Work


def _gather_tables(tables, comm: Comm, check: bool) -> list:
    """All ranks' tables (collective over the flat group); with ``check``, raise on inconsistency."""
    gathered: list = [None] * comm.world_size
    try:
        dist.all_gather_object(gathered, tables, group=comm.group)
    except RuntimeError as exc:
        raise RuntimeError(
            f"rank {comm.rank}: the all-gather of GroupCast/GroupReduce tables at plan construction failed "
            f"(every rank of the group must build its plan; the wait is bounded by the process group's "
            f"timeout): {exc}"
        ) from exc
    if check:
        problems = cross_check(gathered)
        if problems:
            raise ValueError(
                f"group collective tables are inconsistent across ranks (checked at plan construction, on "
                f"rank {comm.rank}):\n  " + "\n  ".join(problems)
            )
    return gathered


#: Bits of the floating dtypes a GroupReduce (sum / avg) takes as a narrower ``input`` than its ``output``:
#: each converts exactly to every wider one here, so sending a narrow input as it is and widening it at the
#: receiver gives the same bits as widening it before sending, with fewer bytes on the wire.
_FLOAT_BITS = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}


def is_narrower_float(input_dtype: torch.dtype, output_dtype: torch.dtype) -> bool:
    """True when ``input_dtype`` widens exactly into ``output_dtype``: fp16 / bf16 into fp32 / fp64, fp32 into
    fp64 (not fp16 <-> bf16, whose ranges differ, nor integer or complex dtypes)."""
    bits_in, bits_out = _FLOAT_BITS.get(input_dtype), _FLOAT_BITS.get(output_dtype)
    return bits_in is not None and bits_out is not None and bits_in < bits_out


def check_tensor_pair(
    input,
    output,
    n_in: int,
    n_out: int,
    device: torch.device | None = None,
    *,
    narrower_input: bool = False,
) -> None:
    """`input` / `output` of a call against the tables' token counts (and the plan's device, if given):
    ValueError / TypeError naming the argument; communicates nothing. ``narrower_input``: ``input`` may
    also be a narrower floating dtype than ``output`` (:func:`is_narrower_float`; GroupReduce sum / avg)."""
    for name, t in (("input", input), ("output", output)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1:
            raise ValueError(f"`{name}` must have tokens on dim 0 (ndim >= 1), got a 0-d tensor")
        if device is not None and t.device != device:
            raise ValueError(
                f"`{name}` is on {t.device} but the plan's index tensors are on {device}; "
                f"build the plan with device={t.device}"
            )
    if input.shape[0] != n_in:
        raise ValueError(f"`input` has {input.shape[0]} tokens but sum(input_split_sizes) = {n_in}")
    if output.shape[0] != n_out:
        raise ValueError(f"`output` has {output.shape[0]} tokens but sum(output_split_sizes) = {n_out}")
    if input.dtype != output.dtype and not (narrower_input and is_narrower_float(input.dtype, output.dtype)):
        rule = (
            " (or `input` a narrower floating dtype: float16/bfloat16 into float32/float64, float32 into float64)"
            if narrower_input
            else ""
        )
        raise TypeError(
            f"`input` dtype {input.dtype} != `output` dtype {output.dtype}; they must match{rule}"
        )
    if input.shape[1:] != output.shape[1:]:
        raise ValueError(
            f"`input` trailing shape {tuple(input.shape[1:])} != `output` trailing shape "
            f"{tuple(output.shape[1:])}; every token must have the same shape"
        )


class _PlanBase:
    __slots__ = ("_all_tables", "_comm", "_debug", "_impl", "_transposed", "device", "tables")

    def _setup(self, tables, group, device, impl, debug, all_tables, check_tables=True) -> None:
        self._comm = resolve_comm(group)
        if tables.world_size != self._comm.world_size:  # pragma: no cover - tables built from comm
            raise AssertionError("tables validated for another world size")
        choice = choose_impl(impl, self._comm)
        self._impl = choice.impl
        self._debug = env_debug() if debug is None else bool(debug)
        self.device = torch.device(device) if device is not None else default_device(self._comm)
        self.tables = tables
        self._transposed = None
        coll_impl = implementation(self._impl)
        # before any communication: an implementation that cannot run here raises on every rank alike
        coll_impl.check_usable(self._comm, self.device, choice.setting)
        if (
            all_tables is None
            and self._comm.world_size > 1
            and (check_tables or self._debug or coll_impl.needs_all_tables)
        ):
            # Local validation above already passed on this rank; from here every rank must take part.
            # The tables of every rank are checked against each other once, here (always: a mismatch would
            # otherwise deliver stale rows or abort the process inside the backend); the per-call check of
            # dtype and trailing shape stays a debug-mode option. Transposed plans reuse them (no gather).
            all_tables = _gather_tables(tables, self._comm, check=True)
        self._all_tables = all_tables
        return coll_impl

    @property
    def impl(self) -> GroupCollectiveImpl:
        """The implementation this plan runs."""
        return self._impl

    @property
    def group(self) -> dist.ProcessGroup:
        """The flat process group whose ranks the tables use."""
        return self._comm.group

    def _check_tensor_pair(
        self, input, output, n_in: int, n_out: int, *, narrower_input: bool = False
    ) -> None:
        check_tensor_pair(input, output, n_in, n_out, self.device, narrower_input=narrower_input)

    def _debug_check_call(self, input: torch.Tensor, output: torch.Tensor) -> None:
        """Debug mode: every rank must pass the same dtypes and trailing shape (collective)."""
        meta: list = [None] * self._comm.world_size
        mine = (str(input.dtype), str(output.dtype), tuple(input.shape[1:]))
        dist.all_gather_object(meta, mine, group=self._comm.group)
        if len(set(meta)) != 1:
            raise ValueError(
                f"ranks passed different (input dtype, output dtype, trailing shape): {dict(enumerate(meta))}"
            )


class GroupCastPlan(_PlanBase):
    """GroupCast with fixed tables: validated once, index tensors precomputed on ``device``.

    Args:
        input_split_sizes: ``n_in`` token counts cutting ``input`` along dim 0.
        output_split_sizes: ``n_out`` token counts cutting ``output`` along dim 0.
        dst_indices: per input piece, the list of ranks it goes to (unique; may be empty).
        src_index: per output piece, the rank it comes from. Pieces from one source arrive in the
            order the source lists them.
        group: ProcessGroup (None: default group) or DeviceMesh; a 2-D ``(inter, intra)`` mesh selects
            the hierarchical implementation unless ``impl`` says otherwise. Table ranks are ranks of the
            (flattened) group.
        device: where index tensors live and where ``input`` / ``output`` must be (default: the current
            CUDA device for NCCL groups, else CPU).
        impl: :class:`GroupCollectiveImpl` (or its string); None reads ``MAGI_GROUP_COLLECTIVE_IMPL``,
            then picks by group.
        debug: also check, on every call, that all ranks pass the same dtype and trailing shape (one
            collective per call); None reads ``MAGI_GROUP_COLLECTIVE_DEBUG``.

    Construction validates the tables locally (ValueError/TypeError naming the argument) before any
    communication, then gathers every rank's tables once and checks them against each other (ValueError
    on every rank naming the (sender, receiver) pair whose sizes disagree). Construction is therefore
    collective: every rank of the group must build its plans, in the same order. ``transpose()`` reuses
    the gathered tables and communicates nothing.
    """

    def __init__(
        self,
        input_split_sizes: Sequence[int],
        output_split_sizes: Sequence[int],
        dst_indices: Sequence[Sequence[int]],
        src_index: Sequence[int],
        *,
        group: object = None,
        device: torch.device | str | None = None,
        impl: GroupCollectiveImpl | str | None = None,
        debug: bool | None = None,
        _all_tables: Sequence[CastTables] | None = None,
        _check_tables: bool = True,
    ) -> None:
        world = resolve_comm(group).world_size
        tables = CastTables.build(input_split_sizes, output_split_sizes, dst_indices, src_index, world)
        coll_impl = self._setup(tables, group, device, impl, debug, _all_tables, _check_tables)
        self._group_arg = group
        self._runner: CastRunner = coll_impl.build_cast(tables, self._comm, self.device, self._all_tables)
        self._n_in = sum(tables.input_split_sizes)
        self._n_out = sum(tables.output_split_sizes)

    __slots__ = ("_group_arg", "_n_in", "_n_out", "_runner")

    @classmethod
    def from_every_rank(
        cls,
        every_rank: Sequence[tuple[Sequence[int], Sequence[int], Sequence[Sequence[int]], Sequence[int]]],
        *,
        group: object = None,
        device: torch.device | str | None = None,
        impl: GroupCollectiveImpl | str | None = None,
        debug: bool | None = None,
    ) -> GroupCastPlan:
        """This rank's plan when every rank knows every rank's tables (e.g. all derived from one plan that
        every rank computes alike): no gather at construction.

        Args:
            every_rank: per rank of the group, in rank order, its ``(input_split_sizes, output_split_sizes,
                dst_indices, src_index)`` as :class:`GroupCastPlan` takes them.
            group, device, impl, debug: as in :class:`GroupCastPlan`.

        The tables are validated and checked against each other here, locally (ValueError naming the
        (sender, receiver) pair that disagrees). Nothing is communicated, so the caller must make sure
        every rank passes the same list (e.g. by comparing a checksum in an exchange it already makes).
        """
        comm = resolve_comm(group)
        world = comm.world_size
        if len(every_rank) != world:
            raise ValueError(f"every_rank must hold the tables of all {world} ranks, got {len(every_rank)}")
        all_tables = [CastTables.build(*tables, world) for tables in every_rank]
        problems = cross_check(all_tables)
        if problems:
            raise ValueError(
                "group collective tables are inconsistent across ranks:\n  " + "\n  ".join(problems)
            )
        mine = every_rank[comm.rank]
        return cls(*mine, group=group, device=device, impl=impl, debug=debug, _all_tables=all_tables)

    def cast(self, input: torch.Tensor, output: torch.Tensor, async_op: bool = False) -> Work:
        """Send ``input`` pieces to their destination sets; write the received pieces into ``output``.

        Args:
            input: ``[n_in_tokens, ...]`` any dtype.
            output: ``[n_out_tokens, ...]`` same dtype and trailing shape; overwritten piece by piece
                (every output row has a source).
            async_op: return at once; ``output`` is final only after ``Work.wait()``.

        Records no autograd graph (use :func:`group_cast` for autograd).
        """
        self._check_tensor_pair(input, output, self._n_in, self._n_out)
        if self._debug:
            self._debug_check_call(input, output)
        with torch.no_grad():
            return self._runner.run(input, output, bool(async_op))

    def transpose(self) -> GroupReducePlan:
        """The GroupReducePlan with transposed tables (same group, device and impl; no communication)."""
        if self._transposed is None:
            t = self.tables.transpose()
            all_t = None if self._all_tables is None else [x.transpose() for x in self._all_tables]
            self._transposed = GroupReducePlan(
                t.input_split_sizes, t.output_split_sizes, t.dst_index, t.src_indices,
                group=self._group_arg, device=self.device, impl=self._impl, debug=self._debug,
                _all_tables=all_t, _check_tables=all_t is not None,
            )  # fmt: skip
        return self._transposed


class GroupReducePlan(_PlanBase):
    """GroupReduce with fixed tables: validated once, index tensors precomputed on ``device``.

    Args:
        input_split_sizes: ``n_in`` token counts cutting ``input`` along dim 0.
        output_split_sizes: ``n_out`` token counts cutting ``output`` along dim 0.
        dst_index: per input piece, the single rank it goes to.
        src_indices: per output piece, the ranks whose pieces are reduced into it (unique; may be empty).
        group, device, impl, debug: as in :class:`GroupCastPlan`.
    """

    def __init__(
        self,
        input_split_sizes: Sequence[int],
        output_split_sizes: Sequence[int],
        dst_index: Sequence[int],
        src_indices: Sequence[Sequence[int]],
        *,
        group: object = None,
        device: torch.device | str | None = None,
        impl: GroupCollectiveImpl | str | None = None,
        debug: bool | None = None,
        _all_tables: Sequence[ReduceTables] | None = None,
        _check_tables: bool = True,
    ) -> None:
        world = resolve_comm(group).world_size
        tables = ReduceTables.build(input_split_sizes, output_split_sizes, dst_index, src_indices, world)
        coll_impl = self._setup(tables, group, device, impl, debug, _all_tables, _check_tables)
        self._group_arg = group
        self._runner: ReduceRunner = coll_impl.build_reduce(tables, self._comm, self.device, self._all_tables)
        self._n_in = sum(tables.input_split_sizes)
        self._n_out = sum(tables.output_split_sizes)
        self._avg_scale = None

    __slots__ = ("_avg_scale", "_group_arg", "_n_in", "_n_out", "_runner")

    def reduce(
        self,
        input: torch.Tensor,
        output: torch.Tensor,
        reduce_op: ReduceOp | str = "sum",
        async_op: bool = False,
        input_lse: torch.Tensor | None = None,
        output_lse: torch.Tensor | None = None,
        deterministic: bool = False,
    ) -> Work:
        """Send ``input`` pieces to one rank each; reduce received pieces into ``output``.

        Args:
            input: ``[n_in_tokens, ...]``; for ``"lse"`` ``[n_in_tokens, heads, ...]`` floating. For
                ``"sum"`` / ``"avg"`` it may be a narrower floating dtype than ``output`` (float16 / bfloat16
                into float32 / float64, float32 into float64): the result has the same bits as with
                ``input.to(output.dtype)``, and the a2av and hierarchical implementations send the narrow
                values (fewer bytes).
            output: ``[n_out_tokens, ...]`` same trailing shape, and ``input``'s dtype unless that is
                narrower as above; the result accumulates onto what it holds (see :class:`ReduceOp`).
            reduce_op: ``"sum"``, ``"avg"`` or ``"lse"`` (or a :class:`ReduceOp`).
            async_op: return at once; ``Work.wait()`` completes communication and the reduction.
            input_lse: ``"lse"`` only: ``[n_in_tokens, heads]`` fp32 log-sum-exp of ``input``.
            output_lse: ``"lse"`` only: ``[n_out_tokens, heads]`` fp32, updated in place; ``-inf`` means
                "nothing yet" (the matching ``output`` rows are then ignored, even if NaN).
            deterministic: every reduction adds each output row's sources in a fixed order, so the same
                inputs give the same bits on every run (the Triton and native reductions always do; this
                makes the torch fallback, used without Triton or for non-contiguous ``output``, do so too).

        Records no autograd graph (use :func:`group_reduce` for autograd).
        """
        op = parse_reduce_op(reduce_op)
        self._check_tensor_pair(input, output, self._n_in, self._n_out, narrower_input=op is not ReduceOp.LSE)
        _validate_reduce_extras(op, input, output, input_lse, output_lse)
        if self._debug:
            self._debug_check_call(input, output)
        with torch.no_grad():
            if input.dtype != output.dtype and not self._runner.narrow_input:
                # this implementation moves and reduces output's dtype: widen first (exact, the same bits;
                # no byte saving)
                input = input.to(output.dtype)
            return self._runner.run(
                input, output, op, input_lse, output_lse, bool(async_op), deterministic=bool(deterministic)
            )

    def avg_row_scale(self) -> torch.Tensor:
        """``[n_out_tokens]`` fp32: 1 / number of sources of each output row's piece (0 if none)."""
        if self._avg_scale is None:
            per_piece = [1.0 / len(s) if s else 0.0 for s in self.tables.src_indices]
            self._avg_scale = torch.repeat_interleave(
                torch.tensor(per_piece, dtype=torch.float32),
                torch.tensor(self.tables.output_split_sizes, dtype=torch.int64),
            ).to(self.device)
        return self._avg_scale

    def transpose(self) -> GroupCastPlan:
        """The GroupCastPlan with transposed tables (same group, device and impl; no communication)."""
        if self._transposed is None:
            t = self.tables.transpose()
            all_t = None if self._all_tables is None else [x.transpose() for x in self._all_tables]
            self._transposed = GroupCastPlan(
                t.input_split_sizes, t.output_split_sizes, t.dst_indices, t.src_index,
                group=self._group_arg, device=self.device, impl=self._impl, debug=self._debug,
                _all_tables=all_t, _check_tables=all_t is not None,
            )  # fmt: skip
        return self._transposed


def _validate_reduce_extras(op: ReduceOp, input, output, input_lse, output_lse) -> None:
    if input.dtype == torch.bool or input.is_complex():
        raise TypeError(f"group_reduce does not reduce {input.dtype} tensors; use a real numeric dtype")
    if op is not ReduceOp.SUM and not input.is_floating_point():
        raise TypeError(f"reduce_op '{op}' needs a floating dtype, got {input.dtype}")
    if op is not ReduceOp.LSE:
        if input_lse is not None or output_lse is not None:
            raise ValueError(
                f"`input_lse`/`output_lse` are only used with reduce_op='lse', got reduce_op='{op}'"
            )
        return
    if input_lse is None or output_lse is None:
        raise ValueError("reduce_op='lse' needs both `input_lse` and `output_lse` ([tokens, heads] fp32)")
    if input.dim() < 2:
        raise ValueError(
            f"reduce_op='lse' needs `input` of shape [tokens, heads, ...], got {tuple(input.shape)}"
        )
    for name, lse, data in (("input_lse", input_lse, input), ("output_lse", output_lse, output)):
        if not isinstance(lse, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(lse).__name__}")
        if lse.dtype != torch.float32:
            raise TypeError(f"`{name}` must be float32, got {lse.dtype}")
        want = tuple(data.shape[:2])
        if tuple(lse.shape) != want:
            raise ValueError(
                f"`{name}` must have shape [tokens, heads] = {list(want)}, got {list(lse.shape)}"
            )
        if lse.device != data.device:
            raise ValueError(f"`{name}` is on {lse.device} but its data tensor is on {data.device}")
