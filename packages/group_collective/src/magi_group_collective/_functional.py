"""Functional API: ``group_cast`` / ``group_reduce`` (plan cache + autograd)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from ._a2av import get_impl
from ._comm import resolve_comm
from ._config import ReduceOp, env_debug, parse_reduce_op
from ._plan import GroupCastPlan, GroupReducePlan, _resolve_impl
from ._work import Work

#: Plans kept by the functional API (least recently used evicted). Only plans whose construction
#: communicates nothing are cached: a hit on one rank and a miss on another must never decide whether a
#: rank enters a collective.
_CACHE_SIZE = 64
_cache: OrderedDict = OrderedDict()


def _freeze(x) -> tuple:
    return tuple(tuple(v) if isinstance(v, (list, tuple)) else v for v in x)


def _get_plan(cls, tables: tuple, group, device: torch.device):
    comm = resolve_comm(group)
    impl = _resolve_impl(None, comm)
    cacheable = not env_debug() and not get_impl(impl).needs_all_tables
    if not cacheable:
        return cls(*tables, group=group, device=device)
    try:
        key = (cls.__name__, *(_freeze(t) for t in tables), comm.group, device)
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


def clear_plan_cache() -> None:
    """Drop the plans cached by :func:`group_cast` / :func:`group_reduce`."""
    _cache.clear()


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
        n_in = sum(plan.tables.input_split_sizes)
        grad_in = grad_out.new_zeros((n_in, *grad_out.shape[1:]))
        plan.transpose().reduce(grad_out.contiguous(), grad_in, reduce_op="sum")
        return grad_in, None, None


class _ReduceFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, input: torch.Tensor, plan: GroupReducePlan, op: ReduceOp, out_shape: tuple
    ) -> torch.Tensor:
        ctx.plan, ctx.op = plan, op
        out = input.new_zeros(out_shape)
        plan.reduce(input, out, reduce_op=op)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # d/dx of reduce(sum) is the transposed cast; avg scales each output row by 1/|sources| first.
        plan: GroupReducePlan = ctx.plan
        g = grad_out.contiguous()
        if ctx.op is ReduceOp.AVG:
            g = g * plan.avg_row_scale().to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
        n_in = sum(plan.tables.input_split_sizes)
        grad_in = g.new_empty((n_in, *g.shape[1:]))
        plan.transpose().cast(g, grad_in)
        return grad_in, None, None, None


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
    plan = _get_plan(GroupCastPlan, tables, group, _device_of(input))
    if _needs_grad(input, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"`output` must be a torch.Tensor, got {type(output).__name__}")
        plan._check_tensor_pair(input, output, plan._n_in, plan._n_out)
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
) -> Work:
    """Transpose of :func:`group_cast`: send each input piece to one rank, reduce into ``output``.

    Args:
        input: ``[sum(input_split_sizes), ...]``; cut along dim 0 into ``input_split_sizes``.
        output: ``[sum(output_split_sizes), ...]`` same dtype and trailing shape; accumulated into.
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

    Returns:
        :class:`Work`. Autograd (sum/avg): when ``input`` or ``output`` requires grad, the call completes
        synchronously; the backward of ``input`` is ``group_cast`` with the transposed tables (avg: of the
        gradient scaled by 1/|sources|). ``"lse"`` has no autograd (NotImplementedError).
    """
    tables = (input_split_sizes, output_split_sizes, dst_index, src_indices)
    plan = _get_plan(GroupReducePlan, tables, group, _device_of(input))
    op = parse_reduce_op(reduce_op)
    if _needs_grad(input, output, input_lse, output_lse):
        if op is ReduceOp.LSE:
            raise NotImplementedError(
                "autograd through group_reduce(reduce_op='lse') is not supported; call it under torch.no_grad()"
            )
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"`output` must be a torch.Tensor, got {type(output).__name__}")
        plan._check_tensor_pair(input, output, plan._n_in, plan._n_out)
        from ._plan import _validate_reduce_extras

        _validate_reduce_extras(op, input, output, input_lse, output_lse)
        delta = _ReduceFn.apply(input, plan, op, tuple(output.shape))
        output.add_(delta)  # accumulate onto output, recorded by autograd
        return Work.completed()
    return plan.reduce(
        input, output, reduce_op=op, async_op=async_op, input_lse=input_lse, output_lse=output_lse
    )
