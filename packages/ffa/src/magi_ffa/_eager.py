"""Autograd of one checked call in eager mode, without the ``magi_ffa::fwd`` / ``magi_ffa::bwd`` custom ops.

A ``torch.library`` custom op costs host time on every call (schema dispatch, its autograd wrapper, the flat
arguments turned back into a call object), which a layer called once per step at 8k tokens notices. Eager
calls carry their :class:`~magi_ffa._call.FFACall` in an ``autograd.Function`` instead; the custom ops stay
the path ``torch.compile`` traces (their fake implementations give it the shapes).
"""

from __future__ import annotations

from typing import Any

import torch

from ._call import BwdIO, FFACall
from ._sink import sink_grad

__all__ = ["EagerAttention"]


class EagerAttention(torch.autograd.Function):
    """``EagerAttention.apply(q, k, v, sink, backend, call) -> (out, lse, max_logits)``.

    ``backend`` is an ``FFABackend`` and ``call`` its checked :class:`FFACall` of these q / k / v / sink (not
    accumulating). out ``[total_q, num_heads_q, head_dim]`` in q's dtype, lse ``[total_q, num_heads_q]`` in
    the accumulator dtype (both contiguous), max_logits float32 ``[num_heads_q]`` when the call asks for
    them, else empty (no gradient). Gradients flow to q, k, v and sink, also through lse.
    """

    @staticmethod
    def forward(ctx: Any, q, k, v, sink, backend, call: FFACall):  # type: ignore[override]
        o, l, m = backend._forward(call)
        o, l = o.contiguous(), l.contiguous()
        if m is None:
            m = q.new_empty(0, dtype=torch.float32)
        ctx.mark_non_differentiable(m)
        # unused outputs' gradients stay None: no zero tensors to build, no dlse pass in the backward
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, o, l, sink)
        # the call without its tensors (the saved ones replace them): nothing in ctx keeps them alive
        ctx.backend, ctx.checked = backend, call.checked
        ctx.scalars = (call.scale, call.softcap, call.deterministic)
        return o, l, m

    @staticmethod
    def backward(ctx: Any, dout, dlse, _dmax):  # type: ignore[override]
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        call = FFACall(q, k, v, ctx.checked, *ctx.scalars)
        dq, dk, dv = ctx.backend._backward(call, BwdIO(dout, out, lse, dlse))
        dsink = None
        if sink is not None and ctx.needs_input_grad[3]:
            dead = None if dlse is None else torch.where(torch.isneginf(lse), 0.0, dlse.to(lse.dtype))
            dsink = sink_grad(dout, out, lse, sink, dead)
        return dq, dk, dv, dsink, None, None
