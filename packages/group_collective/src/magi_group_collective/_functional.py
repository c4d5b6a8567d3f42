"""Functional API: ``group_cast`` / ``group_reduce`` (the prepared-collective cache + autograd + the
status agreement).

Every call (and every backward of one) first runs the host-side status agreement of
:mod:`magi_group_collective.agreement`: each rank validates its tables and tensors locally, then the ranks
exchange one small row: ok / failed, the call, the dtype and trailing shape, and two checksums of the
traffic each rank sends and expects per (sender, receiver) pair. A rank whose input is wrong, or tables
that disagree across ranks (one sends 3 rows, the other expects 4), make every rank raise before any data
moves; the table mismatch is then named pair by pair from a second exchange of the full tables.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ._comm import resolve_comm
from ._config import ReduceOp, env_debug, parse_reduce_op
from ._plan import GroupCastPlan, GroupReducePlan, _validate_reduce_extras, check_tensor_pair
from ._select import choose_impl, implementation
from ._tables import CastTables, ReduceTables, cross_check
from ._work import Work
from .agreement import agree, host_group_of, pair_checksum

#: Plans kept by the functional API (least recently used evicted). Only plans whose construction
#: communicates nothing are cached: a hit on one rank and a miss on another must never decide whether a
#: rank enters a collective.
_CACHE_SIZE = 64
_cache: OrderedDict = OrderedDict()


def _freeze(x) -> tuple:
    return tuple(tuple(v) if isinstance(v, (list, tuple)) else v for v in x)


def _get_plan(cls, tables: tuple, group, device: torch.device):
    comm = resolve_comm(group)
    impl = choose_impl(None, comm).impl
    cacheable = not env_debug() and not implementation(impl).needs_all_tables
    if not cacheable:
        return cls(*tables, group=group, device=device)
    try:
        key = (cls.__name__, *(_freeze(t) for t in tables), comm.group, device, impl)
        hash(key)
    except TypeError:  # unhashable entries: let the plan's validation report them
        return cls(*tables, group=group, device=device)
    plan = _cache.get(key)
    if plan is None:
        # A cached plan must be built without communication (a hit here may be a miss on another rank), so
        # these plans skip the cross-rank table check of construction (debug mode checks every call).
        plan = cls(*tables, group=group, device=device, _check_tables=False)
        _cache[key] = plan
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return plan


def clear_collective_plan_cache() -> None:
    """Empty the prepared-collective cache: the plans :func:`group_cast` / :func:`group_reduce` prepared
    (local: building a functional plan communicates nothing, so ranks may clear at different times)."""
    _cache.clear()
    _checked.clear()


#: Validated tables and their traffic checksums, by table value (so a repeated call validates nothing again).
_checked: OrderedDict = OrderedDict()


def _traffic(tables: CastTables | ReduceTables, rank: int) -> list[int]:
    """[sent, expected]: checksums of the piece sizes this rank sends to / expects from every rank, per
    (sender, receiver) pair. Summed over the ranks, the two totals are equal iff every pair agrees."""
    sends, recvs = tables.sends(), tables.recvs()
    world = tables.world_size
    sent = {(rank, r): tuple(tables.input_split_sizes[i] for i in sends[r]) for r in range(world)}
    expected = {(s, rank): tuple(tables.output_split_sizes[j] for j in recvs[s]) for s in range(world)}
    return [pair_checksum(sent), pair_checksum(expected)]


def _validated(cls, tables: tuple, world: int, rank: int) -> tuple[CastTables | ReduceTables, list[int]]:
    try:
        key = (cls.__name__, *(_freeze(t) for t in tables), world, rank)
        hit = _checked.get(key)
    except TypeError:  # unhashable entries: validation below names them
        key, hit = None, None
    if hit is not None:
        _checked.move_to_end(key)
        return hit
    built = cls.build(*tables, world)
    hit = (built, _traffic(built, rank))
    if key is not None:
        _checked[key] = hit
        if len(_checked) > _CACHE_SIZE:
            _checked.popitem(last=False)
    return hit


def _agree_on_call(call: str, comm, cls, tables: tuple, check, same) -> None:
    """Validate locally (`check`), then agree with every rank (raises on every rank if any failed), then
    check the traffic checksums of all ranks; a mismatch is named pair by pair on every rank."""
    error: Exception | None = None
    traffic: list[int] = []
    values: dict = {}
    try:
        built, traffic = _validated(cls, tables, comm.world_size, comm.rank)
        check(built)
        values = same()
    except (ValueError, TypeError, NotImplementedError) as exc:
        error = exc
    extras = agree(comm.group, call, error=error, same=values, extra=traffic)
    if comm.world_size == 1:
        return
    modulus = 1 << 63
    if sum(x[0] for x in extras) % modulus != sum(x[1] for x in extras) % modulus:
        # every rank saw the same checksums: every rank gathers the tables to name the pairs, and raises
        host = host_group_of(comm.group)
        every = [pickle.loads(b) for b in host.gather_bytes(pickle.dumps(built))]
        problems = cross_check(every) or ["the traffic checksums differ (no pair found: a hash collision?)"]
        raise ValueError(
            f"{call}: the tables of the ranks do not match (rank {comm.rank} of a group of {comm.world_size}; "
            "checked before any data moved):\n  " + "\n  ".join(problems)
        )


def _same(input: torch.Tensor) -> dict:
    """What every rank must pass alike: a dtype or a trailing shape that differs would make the backend
    receive another byte count than it expects (gloo aborts the process) or mix rows of different layouts."""
    return {"dtype": input.dtype, "trailing shape": tuple(input.shape[1:])}


def _device_of(t: object) -> torch.device:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`input` must be a torch.Tensor, got {type(t).__name__}")
    return t.device


class _CastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: torch.Tensor, plan: GroupCastPlan, out_shape: tuple) -> torch.Tensor:
        ctx.plan = plan
        out = input.new_empty(out_shape)
        plan.cast(input, out)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # d/dx of cast is the transposed reduce (sum): a multicast piece gets the sum of its copies' grads.
        plan: GroupCastPlan = ctx.plan
        _agree_on_backward("group_cast (backward)", plan, grad_out)
        n_in = sum(plan.tables.input_split_sizes)
        grad_in = grad_out.new_zeros((n_in, *grad_out.shape[1:]))
        plan.transpose().reduce(grad_out.contiguous(), grad_in, reduce_op="sum")
        return grad_in, None, None


class _ReduceFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, input: torch.Tensor, plan: GroupReducePlan, op: ReduceOp, out_shape: tuple, det: bool
    ) -> torch.Tensor:
        ctx.plan, ctx.op = plan, op
        out = input.new_zeros(out_shape)
        plan.reduce(input, out, reduce_op=op, deterministic=det)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # d/dx of reduce(sum) is the transposed cast; avg scales each output row by 1/|sources| first.
        plan: GroupReducePlan = ctx.plan
        _agree_on_backward("group_reduce (backward)", plan, grad_out)
        g = grad_out.contiguous()
        if ctx.op is ReduceOp.AVG:
            g = g * plan.avg_row_scale().to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
        n_in = sum(plan.tables.input_split_sizes)
        grad_in = g.new_empty((n_in, *g.shape[1:]))
        plan.transpose().cast(g, grad_in)
        return grad_in, None, None, None, None


def _agree_on_backward(call: str, plan, grad: torch.Tensor) -> None:
    """Every rank runs the backward of the call (a rank that skipped it is named instead of awaited)."""
    agree(plan.group, call, same={"dtype": grad.dtype, "trailing shape": tuple(grad.shape[1:])})


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def group_cast(
    input: torch.Tensor,
    output: torch.Tensor,
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    dst_indices: Sequence[Sequence[int]],
    src_index: Sequence[int],
    group: object = None,
    async_op: bool = False,
) -> Work:
    """Multicast all-to-all-v: send input pieces to sets of ranks, write received pieces into ``output``.

    Args:
        input: ``[sum(input_split_sizes), ...]`` any dtype; cut along dim 0 into ``input_split_sizes``.
        output: ``[sum(output_split_sizes), ...]`` same dtype and trailing shape; overwritten.
        input_split_sizes: ``n_in`` token counts of the input pieces.
        output_split_sizes: ``n_out`` token counts of the output pieces.
        dst_indices: per input piece, the ranks it goes to (unique, possibly empty).
        src_index: per output piece, the rank it comes from; pieces from one source arrive in the order
            the source lists them.
        group: ProcessGroup, DeviceMesh (2-D: hierarchical) or None (default group).
        async_op: return at once; ``Work.wait()`` completes communication and post-processing.

    Returns:
        :class:`Work`. Autograd: when ``input`` requires grad, the call completes synchronously and
        ``output`` gets a grad_fn whose backward is ``group_reduce(sum)`` with the transposed tables.
        Plans are cached by table value (see :class:`GroupCastPlan` for the hot path).
    """
    tables = (input_split_sizes, output_split_sizes, dst_indices, src_index)
    comm = resolve_comm(group)  # a bad `group` names no group to tell: it raises here, on this rank only

    def check(built: CastTables) -> None:
        _device_of(input)
        check_tensor_pair(input, output, sum(built.input_split_sizes), sum(built.output_split_sizes))

    _agree_on_call("group_cast", comm, CastTables, tables, check, lambda: _same(input))
    plan = _get_plan(GroupCastPlan, tables, group, input.device)
    if _needs_grad(input, output):
        result = _CastFn.apply(input, plan, tuple(output.shape))
        output.copy_(result)  # recorded by autograd: output now depends on input
        return Work.completed()
    return plan.cast(input, output, async_op=async_op)


def group_reduce(
    input: torch.Tensor,
    output: torch.Tensor,
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    dst_index: Sequence[int],
    src_indices: Sequence[Sequence[int]],
    group: object = None,
    async_op: bool = False,
    reduce_op: str = "sum",
    input_lse: torch.Tensor | None = None,
    output_lse: torch.Tensor | None = None,
    deterministic: bool = False,
) -> Work:
    """Transpose of :func:`group_cast`: send each input piece to one rank, reduce into ``output``.

    Args:
        input: ``[sum(input_split_sizes), ...]``; cut along dim 0 into ``input_split_sizes``. For
            ``"sum"`` / ``"avg"`` it may be a narrower floating dtype than ``output`` (float16 / bfloat16
            into float32 / float64, float32 into float64): the same bits as ``input.to(output.dtype)``, fewer
            bytes sent (see :meth:`GroupReducePlan.reduce`).
        output: ``[sum(output_split_sizes), ...]`` same trailing shape, and ``input``'s dtype unless that
            is narrower as above; accumulated into.
        input_split_sizes: ``n_in`` token counts of the input pieces.
        output_split_sizes: ``n_out`` token counts of the output pieces.
        dst_index: per input piece, the single rank it goes to.
        src_indices: per output piece, the ranks reduced into it (unique, possibly empty).
        group: ProcessGroup, DeviceMesh (2-D: hierarchical) or None (default group).
        async_op: return at once; ``Work.wait()`` completes communication and the reduction.
        reduce_op: ``"sum"``, ``"avg"`` (mean over the piece's sources, added onto ``output``) or
            ``"lse"`` (log-sum-exp merge of partial attention outputs, ``output`` being one term).
        input_lse: ``"lse"`` only: ``[input tokens, heads]`` fp32 log-sum-exp of ``input``.
        output_lse: ``"lse"`` only: ``[output tokens, heads]`` fp32, updated in place (``-inf`` = empty).
        deterministic: sum each output row's sources in a fixed order on every path (see
            :meth:`GroupReducePlan.reduce`).

    Returns:
        :class:`Work`. Autograd (sum/avg): when ``input`` or ``output`` requires grad, the call completes
        synchronously; the backward of ``input`` is ``group_cast`` with the transposed tables (avg: of the
        gradient scaled by 1/|sources|). ``"lse"`` has no autograd (NotImplementedError).
    """
    tables = (input_split_sizes, output_split_sizes, dst_index, src_indices)
    comm = resolve_comm(group)  # a bad `group` names no group to tell: it raises here, on this rank only
    ops: list[ReduceOp] = []

    def check(built: ReduceTables) -> None:
        _device_of(input)
        ops.append(parse_reduce_op(reduce_op))
        if ops[0] is ReduceOp.LSE and _needs_grad(input, output, input_lse, output_lse):
            raise NotImplementedError(
                "autograd through group_reduce(reduce_op='lse') is not supported; call it under torch.no_grad()"
            )
        n_in, n_out = sum(built.input_split_sizes), sum(built.output_split_sizes)
        check_tensor_pair(input, output, n_in, n_out, narrower_input=ops[0] is not ReduceOp.LSE)
        _validate_reduce_extras(ops[0], input, output, input_lse, output_lse)

    def same() -> dict:
        # output's dtype too: it may differ from input's (a narrower input), and ranks must agree on both
        return {**_same(input), "output dtype": output.dtype, "reduce_op": str(ops[0])}

    _agree_on_call("group_reduce", comm, ReduceTables, tables, check, same)
    op = ops[0]
    plan = _get_plan(GroupReducePlan, tables, group, input.device)
    if _needs_grad(input, output, input_lse, output_lse):
        # widened before autograd records the reduce: its backward (a cast) then runs in output's dtype,
        # and the backward of `.to` hands input's gradient back in input's dtype
        wide = input.to(output.dtype)
        delta = _ReduceFn.apply(wide, plan, op, tuple(output.shape), bool(deterministic))
        output.add_(delta)  # accumulate onto output, recorded by autograd
        return Work.completed()
    return plan.reduce(
        input, output, reduce_op=op, async_op=async_op, input_lse=input_lse, output_lse=output_lse,
        deterministic=deterministic,
    )  # fmt: skip
