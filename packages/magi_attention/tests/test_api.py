"""API behaviour on gloo ranks: dispatch round trip and autograd, position ids, a second mask after
dispatch, keys and cache, and bad input raising the same clear error on every rank (never a hang)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from magi_attention import config as cfg
from magi_attention.api import (
    calc_attn,
    clear_cache,
    dispatch,
    get_most_recent_key,
    get_position_ids,
    magi_attn_flex_key,
    magi_attn_varlen_key,
    make_flex_key_for_new_mask_after_dispatch,
    undispatch,
)
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn

TOTAL, HQ, HKV, D = 90, 2, 1, 4


def _config(chunk: int = 6, degree: int | None = 1) -> cfg.DistAttnConfig:
    return cfg.DistAttnConfig(
        dispatch_config=cfg.DispatchConfig(chunk_size=chunk),
        overlap_config=cfg.OverlapConfig(degree=degree, min_chunk_size=4),
    )


def _expect_error(exc_type, match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(exc_type, match=match):
        fn(*args, **kwargs)


def _api_worker(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
    causal_key = magi_attn_varlen_key(
        [0, 40, TOTAL], [0, 40, TOTAL], HQ, HKV, D, group, causal=True, dist_attn_config=_config()
    )

    # Keys hash by value; equal keys built twice share one plan; the newest key is reported.
    again = magi_attn_varlen_key(
        [0, 40, TOTAL], [0, 40, TOTAL], HQ, HKV, D, group, causal=True, dist_attn_config=_config()
    )
    assert again == causal_key and hash(again) == hash(causal_key)
    assert get_most_recent_key(group) == causal_key

    # dispatch / undispatch round trip for any trailing shape, and their autograd.
    x = torch.arange(TOTAL * 3, dtype=torch.float64).reshape(TOTAL, 3).requires_grad_()
    local = dispatch(x, causal_key)
    assert torch.equal(undispatch(local, causal_key), x)
    pos = get_position_ids(causal_key)
    assert pos.dtype == torch.int64 and pos.shape[0] == local.shape[0]
    real = int(
        (local[:, 1] != 0).sum()
    )  # padding rows (zeros) come last; every real row of x has x[:, 1] > 0
    assert torch.equal(local[:real, 0], x.detach()[pos[:real], 0]), (
        "position ids must name the dispatched tokens"
    )
    w = torch.randn(TOTAL, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (undispatch(dispatch(x, causal_key) * 2, causal_key) * w).sum().backward()
    assert torch.allclose(x.grad, 2 * w), "dispatch backward must give every rank the full gradient"

    # Every rank together covers every token exactly once.
    all_pos = [torch.zeros_like(pos) for _ in range(world_size)]
    dist.all_gather(all_pos, pos)
    covered = torch.cat(all_pos)
    assert set(covered.tolist()) == set(range(TOTAL))

    # A second mask (full attention inside documents) over the same dispatch.
    full_key = make_flex_key_for_new_mask_after_dispatch(
        [[0, 40], [40, TOTAL]], [[0, 40], [40, TOTAL]], "full", causal_key
    )
    assert torch.equal(get_position_ids(full_key), pos)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(TOTAL, h, D, dtype=torch.float64, generator=gen) for h in (HQ, HKV, HKV))
    lq, lk, lv = (dispatch(t, causal_key) for t in (q, k, v))
    for key, qr, _kr, ty in (
        (causal_key, [[0, 40], [40, TOTAL]], None, "causal"),
        (full_key, [[0, 40], [40, TOTAL]], None, "full"),
    ):
        out, meta = calc_attn(lq, lk, lv, key)
        types = [1 if ty == "causal" else 0] * 2
        ref, _ref_lse = ref_attn(q, k, v, make_attn_mask(qr, qr, types, TOTAL, TOTAL))
        assert torch.allclose(undispatch(out, key), ref, rtol=1e-10, atol=1e-12), f"{ty} mask after dispatch"
        assert meta.lse.dtype == torch.float64

    # Empty slices hold no pair: they are dropped, at every cp size alike.
    with_empty = magi_attn_flex_key(
        [[0, 40], [5, 5], [40, TOTAL]],
        [[0, 40], [0, 9], [40, TOTAL]],
        "causal",
        TOTAL,
        TOTAL,
        HQ,
        HKV,
        D,
        group,
        _config(),
    )
    assert with_empty.q_ranges == ((0, 40), (40, TOTAL))

    # Bad input: the same clear error on every rank, raised before any collective.
    _expect_error(ValueError, "tokens", calc_attn, lq[1:], lk[1:], lv[1:], causal_key)
    _expect_error(ValueError, "num_heads_q", calc_attn, lq[:, :1], lk, lv, causal_key)
    _expect_error(ValueError, "num_heads_kv", calc_attn, lq, lk.repeat(1, 2, 1), lv, causal_key)
    _expect_error(ValueError, "x must have", dispatch, x[:10], causal_key)
    _expect_error(
        ValueError,
        "q_ranges\\[1\\]",
        magi_attn_flex_key,
        [[0, 5], [80, 95]],
        [[0, 5], [0, 5]],
        0,
        TOTAL,
        TOTAL,
        HQ,
        HKV,
        D,
        group,
    )
    _expect_error(
        ValueError,
        "attn_mask_type",
        magi_attn_flex_key,
        [[0, 5]],
        [[0, 5]],
        "diagonal",
        TOTAL,
        TOTAL,
        HQ,
        HKV,
        D,
        group,
    )
    _expect_error(
        ValueError,
        "multiple of num_heads_kv",
        magi_attn_flex_key,
        [[0, 5]],
        [[0, 5]],
        0,
        TOTAL,
        TOTAL,
        3,
        2,
        D,
        group,
    )
    if world_size > 1:
        # A key built for a group this rank is not in.
        others = dist.new_group([r for r in range(world_size) if r != 0])
        if rank == 0:
            _expect_error(
                ValueError,
                "not in the given group",
                magi_attn_flex_key,
                [[0, 5]],
                [[0, 5]],
                0,
                TOTAL,
                TOTAL,
                HQ,
                HKV,
                D,
                others,
            )
    clear_cache(group)
    assert get_most_recent_key(group) is None


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_api_on_ranks(world_size: int) -> None:
    run_distributed(_api_worker, world_size)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        cfg.DispatchConfig(chunk_size=0)
    with pytest.raises(ValueError, match="alg must be one of"):
        cfg.DispatchConfig(alg="best")
    # None (the default) chooses; a name is used as given
    assert cfg.DispatchConfig().alg is None
    assert cfg.DispatchConfig(alg="documents").alg is cfg.DispatchAlg.DOCUMENTS
    with pytest.raises(ValueError, match="degree"):
        cfg.OverlapConfig(degree=-1)
    assert cfg.OverlapConfig(degree=None).mode == cfg.OverlapMode.DYNAMIC
    with pytest.raises(TypeError, match="overlap_config"):
        cfg.DistAttnConfig(overlap_config=3)
    assert hash(_config()) == hash(_config())


def _one_bad_rank_worker(rank: int, world_size: int) -> None:
    import os

    os.environ["MAGI_ATTENTION_SANITY_CHECK"] = "1"
    group = dist.group.WORLD
    key = magi_attn_varlen_key(
        [0, 40, TOTAL], [0, 40, TOTAL], HQ, HKV, D, group, causal=True, dist_attn_config=_config()
    )
    shard = dispatch(torch.zeros(TOTAL, 1), key).shape[0]
    tokens = shard + 1 if rank == 0 else shard  # only rank 0 passes a wrong tensor
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(tokens, HQ, D, dtype=torch.float64, generator=gen)
    k = torch.randn(tokens, HKV, D, dtype=torch.float64, generator=gen)
    expected = "tokens but this rank's shard" if rank == 0 else "other rank"
    _expect_error(ValueError, expected, calc_attn, q, k, k, key)


def test_sanity_mode_stops_every_rank_when_one_is_wrong() -> None:
    run_distributed(_one_bad_rank_worker, 3, timeout=120)


def test_key_hash_is_computed_once_and_survives_pickling() -> None:
    """A key is looked up on every call: its hash is the hash of its compared fields, computed when it is
    built; a pickled key is rebuilt (string hashes differ between processes); a changed field changes it."""
    import dataclasses
    import pickle

    n = 512
    ranges = [[8 * i, 8 * i + 8] for i in range(n)]
    key = magi_attn_flex_key(ranges, ranges, [1] * n, 8 * n, 8 * n, 2, 1, 8, None, cfg.DistAttnConfig())
    again = magi_attn_flex_key(ranges, ranges, [1] * n, 8 * n, 8 * n, 2, 1, 8, None, cfg.DistAttnConfig())
    assert key == again and hash(key) == hash(again) and key is not again
    compared = tuple(getattr(key, f.name) for f in dataclasses.fields(key) if f.compare)
    assert hash(key) == hash(compared)
    restored = pickle.loads(pickle.dumps(key))
    assert restored == key and hash(restored) == hash(key)
    other = dataclasses.replace(key, head_dim=16)
    assert (
        other != key and other.head_dim == 16 and hash(other) == hash(dataclasses.replace(again, head_dim=16))
    )
