"""The distributed attention forward/backward with multi-stage overlap of compute and communication.

Forward (KV communication): the host stage (local q x local k/v) runs while stage 0's remote K/V is
fetched by GroupCast; every remote stage accumulates into the same fp32 (fp64 for fp64 inputs) out/lse
buffers through FFA's merge-into-out mode, while the next stage's K/V is in flight.

Backward: dQ accumulates across stages; each remote stage's partial dK/dV goes back to its owners with
an async GroupReduce(sum) that overlaps the next stage's compute. The forward's remote K/V is not kept:
it is fetched again stage by stage, so memory holds at most two stages of remote K/V.

Degree 0: all remote K/V arrives in one blocking GroupCast and one FFA call covers local and remote keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._kernels import AttnKernel
from ._runtime import RUNTIME_CACHE, DeviceMeta, DistAttnRuntime, KernelSlices
from ._sanity import device_of, validate_on_all_ranks
from .config import KernelBackend
from .key import DistAttnRuntimeKey


@dataclass(frozen=True, slots=True)
class AttnForwardMeta:
    lse: torch.Tensor
    """`[local_tokens, num_heads_q]` log-sum-exp of each local query row, fp32 (fp64 for fp64 inputs);
    -inf for rows that see no key."""


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _split_kv(kv: torch.Tensor, heads_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[t, 2*hkv, d] -> (k, v) views [t, hkv, d] (K and V travel as one tensor: one collective)."""
    return kv[:, :heads_kv], kv[:, heads_kv:]


class _KVFetcher:
    """Issues the GroupCast of stage i's remote K/V and hands the buffer over when it has arrived."""

    def __init__(self, meta: DeviceMeta, kv_local: torch.Tensor) -> None:
        self.meta = meta
        self.kv_local = kv_local
        self.pending: dict[int, tuple[torch.Tensor, object]] = {}

    def start(self, stage: int) -> None:
        if stage >= len(self.meta.stages) or stage in self.pending:
            return
        shape = (self.meta.remote_tokens[stage], *self.kv_local.shape[1:])
        buf = self.kv_local.new_empty(shape)
        work = self.meta.cast_plans[stage].cast(self.kv_local, buf, async_op=True)
        self.pending[stage] = (buf, work)

    def get(self, stage: int) -> torch.Tensor:
        self.start(stage)
        buf, work = self.pending.pop(stage)
        work.wait()
        return buf


def _fwd_call(kernel: AttnKernel, q, k, v, slices: KernelSlices, out, lse, scale, softcap):
    """One forward kernel call; with `out`/`lse` given its result is merged into them, else fresh ones are
    returned ((None, None) when the call has no slice)."""
    if slices.num_slices == 0:
        return out, lse
    return kernel.fwd(
        q,
        k,
        v,
        slices.q_ranges,
        slices.k_ranges,
        slices.types,
        softmax_scale=scale,
        softcap=softcap,
        out=out,
        lse=lse,
    )


def _bwd_call(kernel: AttnKernel, do, q, k, v, out, lse, slices: KernelSlices, dq, dk, dv, scale, softcap):
    if slices.num_slices == 0:
        return dq, dk, dv
    return kernel.bwd(
        do,
        q,
        k,
        v,
        out,
        lse,
        slices.q_ranges,
        slices.k_ranges,
        slices.types,
        softmax_scale=scale,
        softcap=softcap,
        dq=dq,
        dk=dk,
        dv=dv,
    )


def dist_attn_fwd(q, k, v, runtime: DistAttnRuntime, scale: float, softcap: float):
    """Returns (out in q.dtype, lse in the accumulation dtype)."""
    kernel = runtime.kernel(q.dtype)
    meta = runtime.device_meta(q.device)
    hkv = k.shape[1]
    kv_local = torch.cat([k, v], dim=1)  # K and V travel as one tensor: one collective per stage
    fetcher = _KVFetcher(meta, kv_local)
    if runtime.merged_stage:
        kv_all = torch.cat([kv_local, fetcher.get(0)], dim=0)
        out, lse = _fwd_call(kernel, q, *_split_kv(kv_all, hkv), meta.merged, None, None, scale, softcap)
    else:
        fetcher.start(0)
        # The host call writes the accumulator itself (no zero-fill). With one remote stage the merge can
        # write q's dtype directly (the same single rounding as an fp32 accumulator cast at the end); with
        # more, intermediate merges stay in fp32.
        out, lse = _fwd_call(kernel, q, k, v, meta.host, None, None, scale, softcap)
        if out is not None and len(meta.stages) > 1:
            out = out.to(_acc_dtype(q.dtype))
        for i in range(len(meta.stages)):
            kv_remote = fetcher.get(i)
            fetcher.start(i + 1)
            out, lse = _fwd_call(
                kernel, q, *_split_kv(kv_remote, hkv), meta.stages[i], out, lse, scale, softcap
            )
    if out is None:  # no slice touches this rank's queries
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=_acc_dtype(q.dtype), device=q.device)
    return out.to(q.dtype), lse


def dist_attn_bwd(do, q, k, v, out, lse, runtime: DistAttnRuntime, scale: float, softcap: float):
    kernel = runtime.kernel(q.dtype)
    meta = runtime.device_meta(q.device)
    acc = _acc_dtype(q.dtype)
    hkv = k.shape[1]
    do = do.contiguous()
    kv_local = torch.cat([k, v], dim=1)
    fetcher = _KVFetcher(meta, kv_local)
    if runtime.merged_stage:
        kv_remote = fetcher.get(0)
        kv_all = torch.cat([kv_local, kv_remote], dim=0)
        # one call, no accumulators: the kernel writes dq, dk, dv itself (no zero-filled fp32 buffers)
        dq, dk_all, dv_all = _bwd_call(
            kernel, do, q, *_split_kv(kv_all, hkv), out, lse, meta.merged, None, None, None, scale, softcap
        )
        if dq is None:  # no slice touches this rank's queries
            dq = torch.zeros_like(q)
            dk_all, dv_all = (torch.zeros_like(x) for x in _split_kv(kv_all, hkv))
        n = k.shape[0]
        # partial dK/dV of remote keys go back to their owners and are summed there (fp32 by default)
        red = acc if runtime.key.config.high_precision_grad_reduce else k.dtype
        dkv_local = torch.cat([dk_all[:n], dv_all[:n]], dim=1).to(red)
        dkv_remote = torch.cat([dk_all[n:], dv_all[n:]], dim=1).to(red)
        meta.reduce_plans[0].reduce(dkv_remote, dkv_local, reduce_op="sum", async_op=False)
    else:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv_local = torch.zeros((k.shape[0], 2 * hkv, k.shape[2]), dtype=acc, device=k.device)
        fetcher.start(0)
        _bwd_call(kernel, do, q, k, v, out, lse, meta.host, dq, *_split_kv(dkv_local, hkv), scale, softcap)
        previous_reduce = None
        for i in range(len(meta.stages)):
            kv_remote = fetcher.get(i)
            fetcher.start(i + 1)
            dkv_remote = torch.zeros((kv_remote.shape[0], *dkv_local.shape[1:]), dtype=acc, device=k.device)
            _bwd_call(
                kernel, do, q, *_split_kv(kv_remote, hkv), out, lse, meta.stages[i], dq,
                *_split_kv(dkv_remote, hkv), scale, softcap,
            )  # fmt: skip
            reduce = meta.reduce_plans[i].reduce(dkv_remote, dkv_local, reduce_op="sum", async_op=True)
            if previous_reduce is not None:
                previous_reduce.wait()
            previous_reduce = reduce
        if previous_reduce is not None:
            previous_reduce.wait()
        dq = dq.to(q.dtype)
    dk, dv = _split_kv(dkv_local, hkv)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class DistAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, runtime: DistAttnRuntime, scale: float, softcap: float):
        out, lse = dist_attn_fwd(q, k, v, runtime, scale, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.runtime, ctx.scale, ctx.softcap = runtime, scale, softcap
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = dist_attn_bwd(grad_out, q, k, v, out, lse, ctx.runtime, ctx.scale, ctx.softcap)
        return dq, dk, dv, None, None, None


def _validate_calc_attn(q, k, v, key: DistAttnRuntimeKey, runtime: DistAttnRuntime) -> None:
    shard = runtime.layout.shard_seqlen
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise ValueError(f"{name} must be [local_tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.shape[0] != shard:
            raise ValueError(
                f"{name} has {t.shape[0]} tokens but this rank's shard of the key has {shard}: "
                "pass the dispatched (local) tensor, e.g. dispatch(x, key)"
            )
        if t.shape[2] != key.head_dim:
            raise ValueError(f"{name} head_dim is {t.shape[2]}, the key says {key.head_dim}")
    if q.shape[1] != key.num_heads_q:
        raise ValueError(f"q has {q.shape[1]} heads, the key says num_heads_q={key.num_heads_q}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[1] != key.num_heads_kv:
            raise ValueError(f"{name} has {t.shape[1]} heads, the key says num_heads_kv={key.num_heads_kv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    runtime.kernel_choice.backend_for(q.dtype, key.head_dim)  # an explicit backend that cannot take q's dtype


def calc_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: DistAttnRuntimeKey,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, AttnForwardMeta]:
    """Distributed attention on dispatched tensors.

    Args:
        q: `[shard_seqlen, num_heads_q, head_dim]`, this rank's dispatched queries.
        k, v: `[shard_seqlen, num_heads_kv, head_dim]`, this rank's dispatched keys and values
            (self-attention: the same tokens as q). GQA/MQA: num_heads_q % num_heads_kv == 0.
        key: the runtime key the tensors were dispatched with.
        softmax_scale: defaults to head_dim ** -0.5.
        softcap: if > 0, scores become `softcap * tanh(scores / softcap)`.

    Returns:
        `(out, meta)`: out `[shard_seqlen, num_heads_q, head_dim]` in q's dtype (rows with no keys are 0),
        and `meta.lse` `[shard_seqlen, num_heads_q]` fp32 (fp64 for fp64 inputs, -inf for rows with no keys).
    """
    runtime = RUNTIME_CACHE.get(key)
    validate_on_all_ranks(
        lambda: _validate_calc_attn(q, k, v, key, runtime),
        key.cp_group.group,
        device_of(q),
    )
    scale = key.head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    if key.cp_size == 1:
        return _calc_attn_single(q, k, v, runtime, scale, softcap)
    out, lse = DistAttnFunc.apply(q, k, v, runtime, scale, float(softcap))
    return out, AttnForwardMeta(lse=lse)


def _calc_attn_single(q, k, v, runtime: DistAttnRuntime, scale: float, softcap: float):
    """cp_size 1: one kernel call on the whole mask, no communication."""
    host = runtime.device_meta(q.device).host
    kernel = runtime.kernel(q.dtype)
    if kernel.backend == KernelBackend.FA4:
        import magi_ffa_fa4

        # FA4's own autograd function: the raw kernel's cost, nothing around it
        out, lse = magi_ffa_fa4.flex_flash_attn_func(
            q, k, v, host.q_ranges, host.k_ranges, host.types, softmax_scale=scale, softcap=softcap
        )
    else:
        out, lse = DistAttnFunc.apply(q, k, v, runtime, scale, float(softcap))
    return out, AttnForwardMeta(lse=lse)
