"""calc_attn, dispatch and undispatch inside torch.compile (one graph break per call) and under activation
checkpointing (the recomputed forward gives identical results), with sinks, max logits and lse gradients,
on gloo ranks at cp 1 and 2, and at cp 3 with uneven shards (ranks of different token counts)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from magi_attention.api import calc_attn, dispatch, magi_attn_varlen_key, undispatch
from magi_attention.config import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention.testing import run_distributed

TOTAL, HQ, HKV, D = 64, 4, 2, 8


def _model(x, w, sink, key):
    """dispatch -> projections -> calc_attn (sinks, max logits) -> undispatch; uses out and lse."""
    local = dispatch(x, key)
    q, k, v = ((local @ w[i]).unflatten(-1, (h, D)) for i, h in enumerate((HQ, HKV, HKV)))
    out, meta = calc_attn(q, k, v, key, sink=sink, return_max_logits=True)
    y = undispatch(out.flatten(1), key)
    lse = undispatch(meta.lse, key)
    return (y.tanh().sum() + 0.1 * lse.sum()), meta.max_logits


def _worker(rank: int, world_size: int, uneven: bool = False) -> None:
    import warnings

    # dynamo itself probes `.grad` of non-leaf tensors it wraps (a UserWarning that pytest makes an error)
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    torch._dynamo.reset()
    cfg = DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=4, uneven_shard=uneven),
        overlap_config=OverlapConfig(degree=1),
    )
    key = magi_attn_varlen_key([0, 20, TOTAL], [0, 20, TOTAL], HQ, HKV, D, dist.group.WORLD, causal=True,
                               dist_attn_config=cfg)  # fmt: skip
    if uneven:  # 16 chunks on 3 ranks: 6, 5, 5 (no padding)
        assert sorted(key.shard_seqlens) == [20, 20, 24] and key.pad_size == 0
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOTAL, 16, dtype=torch.float64, generator=gen)
    ws = [torch.randn(16, h * D, dtype=torch.float64, generator=gen) * 0.3 for h in (HQ, HKV, HKV)]
    sink0 = torch.randn(1, HQ, generator=gen)

    def run(fn):
        xs = [x.clone().requires_grad_()] + [w.clone().requires_grad_() for w in ws]
        s = sink0.clone().requires_grad_()
        loss, mx = fn(xs[0], xs[1:], s)
        loss.backward()
        return [loss.detach(), mx] + [t.grad for t in xs] + [s.grad]

    def eager(x, w, s):
        return _model(x, w, s, key)

    def ckpt(x, w, s):
        return checkpoint(_model, x, w, s, key, use_reentrant=False)

    ref = run(eager)
    for name, fn in (
        ("checkpoint", ckpt),
        ("compile", torch.compile(eager, backend="aot_eager")),
        ("compile+checkpoint", torch.compile(ckpt, backend="aot_eager")),
    ):
        got = run(fn)
        for i, (a, b) in enumerate(zip(got, ref)):
            if name == "checkpoint":  # the recomputed forward is the same computation: bitwise
                assert torch.equal(a, b), f"{name}: result {i} differs"
            else:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{name}: result {i}")
    # graph breaks only at the library's calls (dispatch, calc_attn, 2 x undispatch), each a compiler.disable
    explain = torch._dynamo.explain(eager)(x, ws, sink0)
    reasons = [str(b.reason) for b in explain.break_reasons]
    assert explain.graph_break_count <= 4, reasons
    assert all("torch.compiler.disable" in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("world_size", "uneven"), [(1, False), (2, False), (3, True)], ids=["cp1", "cp2", "cp3-uneven"]
)
def test_compile_and_checkpoint(world_size: int, uneven: bool) -> None:
    run_distributed(_worker, world_size, uneven, timeout=300)
