"""MagiAttention's helpers: roll, padding arithmetic and the key's pad_size / chunk_size, a varlen mask
after dispatch, batch <-> packed helpers, dispatch's pad_value, re-exported names (fp64 on gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import magi_attention.api as api
from magi_attention import DispatchConfig, DistAttnConfig, OverlapMode
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_solver import make_sliding_window_mask

SHIFTS = (0, 1, -1, 7, -13, 53)


def _roll_worker(rank: int, world_size: int, total: int, chunk: int) -> list[str]:
    key = api.magi_attn_flex_key(
        [[0, total]], [[0, total]], "causal", total, total, 2, 1, 8, dist.group.WORLD,
        DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=chunk)),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(total, 3, dtype=torch.float64, generator=gen)
    w = torch.randn(total, 3, dtype=torch.float64, generator=gen)
    checked = []
    for shift in SHIFTS:
        xg = x.clone().requires_grad_()
        local = api.roll(api.dispatch(xg, key), shift, 0, key)
        assert torch.equal(api.undispatch(local.detach(), key), torch.roll(x, shift, 0)), shift
        (local * api.dispatch(w, key)).sum().backward()
        assert torch.allclose(xg.grad, torch.roll(w, -shift, 0)), shift
        # the token dimension need not be the first
        local_t = api.dispatch(x, key).t().contiguous()  # [3, shard]
        rolled = api.roll(local_t, shift, 1, key).t()
        assert torch.equal(api.undispatch(rolled.contiguous(), key), torch.roll(x, shift, 0)), shift
        checked.append(f"shift {shift}")
    with pytest.raises(ValueError, match="dispatched tensor"):
        api.roll(x, 1, 0, key) if world_size > 1 else api.roll(x[:-1], 1, 0, key)
    with pytest.raises(TypeError, match="shift"):
        api.roll(api.dispatch(x, key), 1.5, 0, key)
    return checked


@pytest.mark.parametrize(("world_size", "total", "chunk"), [(1, 50, 50), (2, 50, 5), (3, 50, 4)])
def test_roll_equals_torch_roll_of_the_global_tensor(world_size: int, total: int, chunk: int) -> None:
    for checked in run_distributed(_roll_worker, world_size, total, chunk, timeout=240):
        assert len(checked) == len(SHIFTS)


def test_compute_pad_size() -> None:
    assert api.compute_pad_size(50, 3, 4) == 10
    assert api.compute_pad_size(48, 3, 4) == 0
    assert api.compute_pad_size(1, 8, 2048) == 8 * 2048 - 1
    for bad in ((0, 2, 4), (10, 0, 4), (10, 2, 1.5), (True, 2, 4)):
        with pytest.raises(ValueError):
            api.compute_pad_size(*bad)


def _key_args_worker(rank: int, world_size: int) -> str:
    group = dist.group.WORLD
    args = ([[0, 50]], [[0, 50]], "causal", 50, 50, 2, 1, 8, group)
    key = api.magi_attn_flex_key(*args, pad_size=api.compute_pad_size(50, world_size, 4), chunk_size=4)
    assert key.config.dispatch_config.chunk_size == 4
    with pytest.raises(ValueError, match="pad_size"):
        api.magi_attn_flex_key(*args, pad_size=3, chunk_size=4)
    with pytest.raises(ValueError, match="chunk_size"):
        api.magi_attn_flex_key(
            *args, DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=5)), chunk_size=4
        )
    vkey = api.magi_attn_varlen_key([0, 20, 50], [0, 20, 50], 2, 1, 8, group, causal=True, chunk_size=5)
    assert vkey.config.dispatch_config.chunk_size == 5
    # a sliding-window mask over the same dispatch: attention equals dense fp64 on it
    swa = api.make_varlen_key_for_new_mask_after_dispatch(
        [0, 20, 50], [0, 20, 50], vkey, causal=True, window_size=(6, 3)
    )
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(50, h, 8, dtype=torch.float64, generator=gen) for h in (2, 1, 1))
    out, _ = api.calc_attn(api.dispatch(q, vkey), api.dispatch(k, vkey), api.dispatch(v, vkey), swa)
    mask = make_sliding_window_mask([0, 20, 50], (6, 0))
    dense = make_attn_mask(
        [[r.start, r.end] for r in mask.q_ranges], [[r.start, r.end] for r in mask.k_ranges],
        [t.code for t in mask.types], 50, 50,
    )  # fmt: skip
    ref, _ = ref_attn(q, k, v, dense)
    torch.testing.assert_close(api.undispatch(out, vkey), ref, rtol=1e-10, atol=1e-12)
    labels = api.dispatch(torch.arange(50), vkey, pad_value=-100)
    runtime_pad = (labels == -100).sum()
    dist.all_reduce(runtime_pad)
    assert int(runtime_pad) == api.compute_pad_size(50, world_size, 5)
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_key_pad_and_chunk_arguments(world_size: int) -> None:
    assert run_distributed(_key_args_worker, world_size, timeout=240) == ["ok"] * world_size


def test_batch_helpers_and_names() -> None:
    x = torch.arange(24).reshape(2, 3, 4)
    assert api.squash_batch_dim(x).shape == (6, 4)
    assert torch.equal(api.squash_batch_dim(x)[3], x[1, 0])
    cu_q, cu_k = api.infer_varlen_mask_from_batch(3, 5)
    assert cu_q.tolist() == [0, 5, 10, 15] and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    with pytest.raises(ValueError):
        api.squash_batch_dim(torch.zeros(3))
    assert api.AttnOverlapMode is OverlapMode
    assert api.AttnMaskType("causal").code == 1


@pytest.mark.parametrize("cu", [[0, 2.5, 6], torch.tensor([0.0, 3.0, 6.0]), [0, True, 6]])
def test_float_cu_seqlens_are_rejected(cu) -> None:
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        api.magi_attn_varlen_key(cu, cu, 2, 1, 8, None)
