"""The distributed attention forward/backward with multi-stage overlap of compute and communication.
Part of the product (`api`, `dispatch`, `dist_attn`, `config`); `magi_attention.api` re-exports `calc_attn`.

Forward (KV communication): the host stage (local q x local k/v) runs while stage 0's remote K/V is
fetched by GroupCast; every remote stage accumulates into the same fp32 (fp64 for fp64 inputs) out/lse
buffers through FFA's merge-into-out mode, while the next stage's K/V is in flight.

Backward: dQ accumulates across stages; each remote stage's partial dK/dV goes back to its owners with
an async GroupReduce(sum) that overlaps the next stage's compute. The forward's remote K/V is not kept:
it is fetched again stage by stage, so memory holds at most two stages of remote K/V.

Degree 0: all remote K/V arrives in one blocking GroupCast and one FFA call covers local and remote keys;
its partial dK/dV of remote keys go back in the kernel's dtype (bf16 for bf16 inputs) and are summed into
the owner's fp32 accumulator (with `high_precision_grad_reduce`). Degree >= 1 sends each stage's
accumulator (fp32; fp64 for fp64 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from magi_ffa import merge_sink, sink_grad
from magi_ffa.validation import acc_dtype  # the FFA contract's out / lse dtype, defined once there

from ._runtime.cache import DeviceMeta, DistAttnRuntime, KernelSlices
from ._runtime.checks import (
    agree_on_call,
    build_device_meta_together,
    comm_step,
    needs_device_meta,
    tag_output,
    validate_calc_attn,
)
from ._runtime.compile_break import graph_break
from ._runtime.kernels import AttnKernel
from .key import DistAttnRuntimeKey


@dataclass(frozen=True, slots=True)
class AttnForwardMeta:
    lse: torch.Tensor
    """`[local_tokens, num_heads_q]` log-sum-exp of each local query row, fp32 (fp64 for fp64 inputs);
    -inf for rows that see no key (with sinks: the sinks' finite lse). Differentiable at every cp size."""
    max_logits: torch.Tensor | None = None
    """With `return_max_logits=True`: fp32 `[num_heads_q]`, per head the largest scaled (soft-capped) score
    over every visible (q, k) pair of the whole attention (all ranks; -inf if none), the same on every rank.
    Else None."""


class _Extras:
    """A call's sinks (merged into the first kernel call that runs, or at the end) and its max logits."""

    def __init__(self, sink: torch.Tensor | None, want_max: bool) -> None:
        self.sink = sink
        self.maxes: list[torch.Tensor] | None = [] if want_max else None
        self.max_logits: torch.Tensor | None = None

    def kwargs(self) -> dict:
        kw: dict = {}
        if self.sink is not None:
            kw["sink"] = self.sink
        if self.maxes is not None:
            kw["return_max_logits"] = True
        return kw

    def take(self, res: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        self.sink = None  # merged by this call
        if self.maxes is not None:
            self.maxes.append(res[2])
        return res[0], res[1]

    def finish(self, out, lse, num_heads: int, cp_group) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge sinks no kernel call took; reduce the max logits over the calls and the cp group."""
        if self.sink is not None:
            o, lse = merge_sink(out, lse, self.sink)
            out, self.sink = o.to(out.dtype), None
        if self.maxes is not None:
            mx = torch.full((num_heads,), float("-inf"), dtype=torch.float32, device=lse.device)
            for m in self.maxes:
                mx = torch.maximum(mx, m)
            if cp_group is not None and cp_group.size > 1:
                with comm_step(cp_group, "all-reduce(MAX) of the max logits in the forward of calc_attn"):
                    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=cp_group.group)
            self.max_logits = mx
        return out, lse


def _split_kv(kv: torch.Tensor, heads_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[t, 2*hkv, d] -> (k, v) views [t, hkv, d] (K and V travel as one tensor: one collective)."""
    return kv[:, :heads_kv], kv[:, heads_kv:]


def _merged_kv(k: torch.Tensor, v: torch.Tensor, meta: DeviceMeta, cp_group, phase: str) -> torch.Tensor:
    """The merged call's keys (overlap degree 0), ``[own + received tokens, 2*hkv, d]`` in k's dtype: this
    rank's K and V joined in the leading rows, the GroupCast's received K/V written behind them. One copy of
    the own rows and none of the received ones (which outnumber them several times on a rank holding pieces
    of long documents). K and V travel as one tensor: one collective."""
    n = k.shape[0]
    kv = k.new_empty((n + meta.remote_tokens[0], 2 * k.shape[1], k.shape[2]))
    torch.cat([k, v], dim=1, out=kv[:n])
    _KVFetcher(meta, kv[:n], cp_group, phase).get(0, out=kv[n:])
    return kv


class _KVFetcher:
    """Issues the GroupCast of stage i's remote K/V and hands the buffer over when it has arrived."""

    def __init__(
        self, meta: DeviceMeta, kv_local: torch.Tensor, cp_group=None, phase: str = "forward"
    ) -> None:
        self.meta = meta
        self.kv_local = kv_local
        self.pending: dict[int, tuple[torch.Tensor, object]] = {}
        self.cp_group, self.phase = cp_group, phase

    def _what(self, stage: int) -> str:
        return f"GroupCast of stage {stage} (remote K/V) in the {self.phase} of calc_attn"

    def start(self, stage: int, out: torch.Tensor | None = None) -> None:
        """Issue stage ``stage``'s GroupCast into ``out`` (None: a new buffer)."""
        if stage >= len(self.meta.stages) or stage in self.pending:
            return
        shape = (self.meta.remote_tokens[stage], *self.kv_local.shape[1:])
        buf = self.kv_local.new_empty(shape) if out is None else out
        with comm_step(self.cp_group, self._what(stage)):
            work = self.meta.cast_plans[stage].cast(self.kv_local, buf, async_op=True)
        self.pending[stage] = (buf, work)

    def get(self, stage: int, out: torch.Tensor | None = None) -> torch.Tensor:
        self.start(stage, out)
        buf, work = self.pending.pop(stage)
        with comm_step(self.cp_group, self._what(stage)):
            work.wait()
        return buf


def _fwd_call(
    kernel: AttnKernel, q, k, v, slices: KernelSlices, out, lse, scale, softcap, extras=None, *,
    deterministic: bool,
):  # fmt: skip
    """One forward kernel call; with `out`/`lse` given its result is merged into them, else fresh ones are
    returned ((None, None) when the call has no slice). `extras`: sinks / max logits (`_Extras`);
    `deterministic`: the key's `DistAttnConfig.deterministic`."""
    if slices.num_slices == 0:
        return out, lse
    kw = extras.kwargs() if extras is not None else {}
    res = kernel.fwd_slices(
        q, k, v, slices, softmax_scale=scale, softcap=softcap, deterministic=deterministic, out=out,
        lse=lse, **kw,
    )  # fmt: skip
    return extras.take(res) if extras is not None else res


def _bwd_call(
    kernel: AttnKernel, do, q, k, v, out, lse, slices: KernelSlices, dq, dk, dv, scale, softcap, dlse=None,
    *, deterministic: bool,
):  # fmt: skip
    """One backward kernel call, accumulated into dq / dk / dv when given ((None,) * 3 without slices and
    buffers). `dlse`: the gradient of a differentiable lse (`Delta = rowsum(do * out) - dlse`)."""
    if slices.num_slices == 0:
        return dq, dk, dv
    return kernel.bwd_slices(
        do, q, k, v, out, lse, slices, softmax_scale=scale, softcap=softcap, deterministic=deterministic,
        dq=dq, dk=dk, dv=dv, dlse=dlse,
    )  # fmt: skip


def dist_attn_fwd(q, k, v, runtime: DistAttnRuntime, scale: float, softcap: float, *, extras=None):
    """Returns (out in q.dtype, lse in the accumulation dtype). `extras` (`_Extras`): sinks merged into the
    first kernel call that runs; max logits reduced into `extras.max_logits` (all-reduce MAX over the group)."""
    kernel = runtime.kernel(q.dtype, softcap)
    det = runtime.key.config.deterministic
    cp_group = runtime.key.cp_group
    with comm_step(cp_group, "building the GroupCast plans (tables checked across ranks) of calc_attn"):
        meta = runtime.device_meta(q.device)
    hkv = k.shape[1]
    if runtime.merged_stage:
        kv_all = _merged_kv(k, v, meta, cp_group, "forward")
        out, lse = _fwd_call(
            kernel, q, *_split_kv(kv_all, hkv), meta.merged, None, None, scale, softcap, extras,
            deterministic=det,
        )  # fmt: skip
    else:
        fetcher = _KVFetcher(meta, torch.cat([k, v], dim=1), cp_group, "forward")
        fetcher.start(0)
        # The host call writes the accumulator itself (no zero-fill). With one remote stage the merge can
        # write q's dtype directly (the same single rounding as an fp32 accumulator cast at the end); with
        # more, intermediate merges stay in fp32.
        out, lse = _fwd_call(
            kernel, q, k, v, meta.host, None, None, scale, softcap, extras, deterministic=det
        )
        if out is not None and len(meta.stages) > 1:
            out = out.to(acc_dtype(q.dtype))
        for i in range(len(meta.stages)):
            kv_remote = fetcher.get(i)
            fetcher.start(i + 1)
            out, lse = _fwd_call(
                kernel, q, *_split_kv(kv_remote, hkv), meta.stages[i], out, lse, scale, softcap, extras,
                deterministic=det,
            )  # fmt: skip
    if out is None:  # no slice touches this rank's queries
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    if extras is not None:
        out, lse = extras.finish(out, lse, q.shape[1], runtime.key.cp_group)
    return out.to(q.dtype), lse


def dist_attn_bwd(do, q, k, v, out, lse, runtime: DistAttnRuntime, scale: float, softcap: float, dlse=None):
    """dq, dk, dv of this rank's q/k/v given the final out/lse and, optionally, the lse's gradient `dlse`."""
    kernel = runtime.kernel(q.dtype, softcap)
    det = runtime.key.config.deterministic
    meta = runtime.device_meta(q.device)
    acc = acc_dtype(q.dtype)
    hkv = k.shape[1]
    do = do.contiguous()
    cp_group = runtime.key.cp_group
    n = k.shape[0]
    if runtime.merged_stage:
        kv_all = _merged_kv(k, v, meta, cp_group, "backward")
        # one call, no accumulators: the kernel writes dq, dk, dv itself (no zero-filled fp32 buffers)
        dq, dk_all, dv_all = _bwd_call(
            kernel, do, q, *_split_kv(kv_all, hkv), out, lse, meta.merged, None, None, None, scale, softcap,
            dlse, deterministic=det,
        )  # fmt: skip
        if dq is None:  # no slice touches this rank's queries
            dq = torch.zeros_like(q)
            dk_all, dv_all = (torch.zeros_like(x) for x in _split_kv(kv_all, hkv))
        # partial dK/dV of remote keys go back to their owners and are summed there (fp32 by default). They
        # travel in the kernel's dtype: the owner's GroupReduce widens them exactly into `red`, the same bits
        # as widening before sending, with half the bytes for bf16 / fp16
        red = acc if runtime.key.config.high_precision_grad_reduce else k.dtype
        # joined and widened in one pass (cat writes its `out` dtype)
        dkv_local = torch.cat(
            [dk_all[:n], dv_all[:n]], dim=1, out=k.new_empty((n, 2 * hkv, k.shape[2]), dtype=red)
        )
        dkv_remote = torch.cat([dk_all[n:], dv_all[n:]], dim=1)
        with comm_step(cp_group, "GroupReduce of stage 0 (remote dK/dV) in the backward of calc_attn"):
            meta.reduce_plans[0].reduce(
                dkv_remote, dkv_local, reduce_op="sum", async_op=False, deterministic=det
            )
    else:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv_local = torch.zeros((n, 2 * hkv, k.shape[2]), dtype=acc, device=k.device)
        fetcher = _KVFetcher(meta, torch.cat([k, v], dim=1), cp_group, "backward")
        fetcher.start(0)
        _bwd_call(
            kernel, do, q, k, v, out, lse, meta.host, dq, *_split_kv(dkv_local, hkv), scale, softcap, dlse,
            deterministic=det,
        )  # fmt: skip
        previous_reduce = None
        for i in range(len(meta.stages)):
            kv_remote = fetcher.get(i)
            fetcher.start(i + 1)
            dkv_remote = torch.zeros((kv_remote.shape[0], *dkv_local.shape[1:]), dtype=acc, device=k.device)
            _bwd_call(
                kernel, do, q, *_split_kv(kv_remote, hkv), out, lse, meta.stages[i], dq,
                *_split_kv(dkv_remote, hkv), scale, softcap, dlse, deterministic=det,
            )  # fmt: skip
            with comm_step(cp_group, _reduce_what(i)):
                reduce = meta.reduce_plans[i].reduce(
                    dkv_remote, dkv_local, reduce_op="sum", async_op=True, deterministic=det
                )
            if previous_reduce is not None:
                with comm_step(cp_group, _reduce_what(i - 1)):
                    previous_reduce.wait()
            previous_reduce = reduce
        if previous_reduce is not None:
            with comm_step(cp_group, _reduce_what(len(meta.stages) - 1)):
                previous_reduce.wait()
        dq = dq.to(q.dtype)
    dk, dv = _split_kv(dkv_local, hkv)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _reduce_what(stage: int) -> str:
    return f"GroupReduce of stage {stage} (remote dK/dV) in the backward of calc_attn"


def _save_outputs(ctx, q, k, v, out, lse, sink, max_logits):
    """The forward tail of both autograd Functions: save what their backward reads (sink only when given)
    and return `(out, lse)`, or `(out, lse, max_logits)` with max_logits non-differentiable."""
    ctx.save_for_backward(q, k, v, out, lse, *((sink,) if sink is not None else ()))
    if max_logits is None:
        return out, lse
    ctx.mark_non_differentiable(max_logits)
    return out, lse, max_logits


def _saved(ctx, grad_out):
    """The backward head of both autograd Functions: `(q, k, v, out, lse, sink or None, grad_out)`, a
    missing output gradient (only lse or max logits were used) as zeros."""
    q, k, v, out, lse, *sink = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    return q, k, v, out, lse, (sink[0] if sink else None), grad_out


class DistAttnFunc(torch.autograd.Function):
    """`apply(q, k, v, runtime, scale, softcap, sink=None, return_max_logits=False)` -> `(out, lse)`, or
    `(out, lse, max_logits)`. out, lse (its gradient enters as `Delta = rowsum(dO * O) - dlse`) and sink are
    differentiable; sink's gradient holds this rank's query rows only (DDP / FSDP sum it over the ranks)."""

    @staticmethod
    def forward(
        ctx, q, k, v, runtime: DistAttnRuntime, scale: float, softcap: float, sink=None, ret_max=False
    ):
        extras = _Extras(sink, bool(ret_max))
        out, lse = dist_attn_fwd(q, k, v, runtime, scale, softcap, extras=extras)
        ctx.runtime, ctx.scale, ctx.softcap = runtime, scale, softcap
        return _save_outputs(ctx, q, k, v, out, lse, sink, extras.max_logits if ret_max else None)

    @staticmethod
    def backward(ctx, grad_out, grad_lse, *_grad_max):
        q, k, v, out, lse, sink, grad_out = _saved(ctx, grad_out)
        # Every rank runs the backward before any data moves: a rank that skipped it (or is in another
        # call) is named instead of awaited; a rank without the plan's device tensors makes all rebuild.
        runtime = ctx.runtime
        flags = agree_on_call(
            runtime.key.cp_group,
            "calc_attn (backward)",
            lambda: None,
            same=lambda: {"grad.dtype": grad_out.dtype},
            extra=lambda: needs_device_meta(runtime, q.device),
        )
        build_device_meta_together(runtime, q.device, flags)
        dq, dk, dv = dist_attn_bwd(
            grad_out, q, k, v, out, lse, ctx.runtime, ctx.scale, ctx.softcap, dlse=grad_lse
        )
        dsink = None
        if sink is not None and ctx.needs_input_grad[6]:
            dsink = sink_grad(grad_out, out, lse, sink, grad_lse)
        return dq, dk, dv, None, None, None, dsink, None


@graph_break  # torch.compile: one graph break per call (docs/packages/magi_attention.md)
def calc_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: DistAttnRuntimeKey,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    *,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
) -> tuple[torch.Tensor, AttnForwardMeta]:
    """Distributed attention on dispatched tensors.

    Args:
        q: `[shard_seqlen, num_heads_q, head_dim]`, this rank's dispatched queries.
        k, v: this rank's dispatched keys and values, `[shard_seqlen, num_heads_kv, head_dim]` (self-attention:
            the same tokens as q, from `dispatch`) or `[kv_shard_seqlen, num_heads_kv, head_dim]`
            (cross-attention: from `dispatch_kv`). GQA/MQA: num_heads_q % num_heads_kv == 0.
        key: the runtime key the tensors were dispatched with.
        softmax_scale: defaults to head_dim ** -0.5.
        softcap: if > 0, scores become `softcap * tanh(scores / softcap)`.
        sink: optional attention sinks, fp32 `[num_sink, num_heads_q]`, the same tensor on every rank
            (e.g. a replicated parameter): every query row's softmax also counts the logits `sink[:, h]`,
            which carry no value; `meta.lse` includes them, rows with no visible key get out 0 and a finite
            lse. Differentiable: each rank's `sink.grad` holds its own query rows' contribution, and the
            usual gradient reduction over the cp ranks (DDP / FSDP) sums them.
        return_max_logits: fill `meta.max_logits`, fp32 `[num_heads_q]`: the largest scaled (soft-capped)
            score over every visible (q, k) pair of the whole attention, the same on every rank (one
            all-reduce MAX of `num_heads_q` floats; for QK-clip).

    Returns:
        `(out, meta)`: out `[shard_seqlen, num_heads_q, head_dim]` in q's dtype (rows with no keys are 0),
        and `meta.lse` `[shard_seqlen, num_heads_q]` fp32 (fp64 for fp64 inputs, -inf for rows with no keys),
        differentiable; `meta.max_logits` (None unless asked for).
    """
    call = validate_calc_attn(q, k, v, key, softmax_scale, softcap, sink, return_max_logits)
    runtime, scale, cap, ret_max = call.runtime, call.softmax_scale, call.softcap, call.return_max_logits
    if key.cp_size == 1:
        return _calc_attn_single(q, k, v, runtime, scale, cap, call.sink, ret_max)
    out, lse, *mx = DistAttnFunc.apply(q, k, v, runtime, scale, cap, call.sink, ret_max)
    tag_output(out, runtime), tag_output(lse, runtime)
    return out, AttnForwardMeta(lse=lse, max_logits=mx[0] if mx else None)


class _SingleCall(torch.autograd.Function):
    """cp_size 1: one launcher call each way on the plan's checked slices (`AttnKernel.fwd_slices` /
    `bwd_slices`, the one FFA contract): the forward on `kernel.backend`, the backward on
    `kernel.backward_backend` (`auto` may split them), starting from this forward's out / lse. Sinks, max
    logits, `dlse` and the deterministic flag are the contract's."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, host, scale: float, softcap: float, sink, ret_max: bool, det: bool):
        kw = {} if sink is None else {"sink": sink}
        res = kernel.fwd_slices(
            q, k, v, host, softmax_scale=scale, softcap=softcap, deterministic=det, return_max_logits=ret_max,
            **kw,
        )  # fmt: skip
        ctx.kernel, ctx.host, ctx.scale, ctx.softcap, ctx.det = kernel, host, scale, softcap, det
        ctx.set_materialize_grads(False)
        return _save_outputs(ctx, q, k, v, res[0], res[1], sink, res[2] if ret_max else None)

    @staticmethod
    def backward(ctx, dout, dlse, *_dmax):
        q, k, v, out, lse, sink, dout = _saved(ctx, dout)
        kw = {} if sink is None else {"sink": sink}
        grads = ctx.kernel.bwd_slices(
            dout.contiguous(), q, k, v, out, lse, ctx.host, softmax_scale=ctx.scale, softcap=ctx.softcap,
            deterministic=ctx.det, dlse=dlse, **kw,
        )  # fmt: skip
        dsink = grads[3] if sink is not None else None
        return grads[0], grads[1], grads[2], None, None, None, None, dsink, None, None


def _calc_attn_single(
    q, k, v, runtime: DistAttnRuntime, scale: float, softcap: float, sink=None, ret_max: bool = False
):
    """cp_size 1: one kernel call on the whole mask, no communication."""
    host = runtime.device_meta(q.device).host
    kernel = runtime.kernel(q.dtype, softcap)
    det = runtime.key.config.deterministic
    out, lse, *mx = _SingleCall.apply(q, k, v, kernel, host, scale, float(softcap), sink, bool(ret_max), det)
    return out, AttnForwardMeta(lse=lse, max_logits=mx[0] if mx else None)
