"""Eager kernel-API calls run their autograd without the custom ops (host time per call); the gradients are
the op path's."""

from __future__ import annotations

import torch

from magi_ffa import contract


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(48, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(40, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(40, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    tables = ([[0, 20], [16, 48], [0, 48]], [[0, 24], [8, 40], [30, 36]], [1, 3, 0])
    return q, k, v, sink, tables


def _grads(run):
    q, k, v, sink, tables = _inputs()
    out, lse = run(q, k, v, sink, tables)
    (out.square().sum() + lse.sum()).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, sink.grad


def test_eager_call_skips_the_custom_ops_and_matches_them(monkeypatch) -> None:
    backend = contract.get_backend("torch")

    def eager(q, k, v, sink, tables):
        out, lse = backend.flex_flash_attn_func(q, k, v, *tables, sink=sink)
        assert type(out.grad_fn).__name__ == "EagerAttentionBackward"
        return out, lse

    def through_ops(q, k, v, sink, tables):
        call = backend._call(
            q, k, v, contract.checked_of(tables, q, k), contract.Options(sink=sink), q.shape[-1] ** -0.5
        )
        c = call.checked
        o, l, _ = torch.ops.magi_ffa.fwd(q, k, v, c.q_ranges, c.k_ranges, c.types, call.scale, 0.0, False, sink,
                                         False, "torch")  # fmt: skip
        return o, l

    ops_result = _grads(through_ops)

    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(torch.ops.magi_ffa, "fwd", refuse)
    eager_result = _grads(eager)
    for a, b in zip(eager_result, ops_result, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
