"""`get_dispatch_choice`: the runtime's chunk size and algorithm per mask, the same on every rank, an
explicit size kept, and the runtime's dispatch equal to the planner's (one gloo launch of two ranks)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch.distributed as dist

import magi_attention
from magi_attention import config as cfg
from magi_attention.api import (
    clear_cache,
    get_dispatch_choice,
    magi_attn_varlen_key,
    make_varlen_key_for_new_mask_after_dispatch,
)
from magi_attention.testing import run_distributed
from magi_solver import DispatchChoice, dispatch_choice, long_tailed_cu_seqlens

HQ, HKV, D = 2, 1, 8


def _choice_worker(rank: int, world_size: int) -> list[dict]:
    group = dist.group.WORLD
    total = 4096
    cu = long_tailed_cu_seqlens(total, seed=3)
    got = []
    for chunk in (None, 64):
        conf = cfg.DistAttnConfig(dispatch_config=cfg.DispatchConfig(chunk_size=chunk))
        key = magi_attn_varlen_key(cu, cu, HQ, HKV, D, group, causal=True, dist_attn_config=conf)
        choice = get_dispatch_choice(key)
        assert isinstance(choice, DispatchChoice) and dataclasses.is_dataclass(choice)
        # the runtime's dispatch is the planner's (a pure function of the global mask and cp size)
        ranges = [list(p) for p in itertools.pairwise(cu)]
        alone, dispatch = dispatch_choice(ranges, ranges, "causal", total, world_size, chunk_size=chunk)
        assert (choice.chunk_size, choice.algorithm) == (alone.chunk_size, alone.algorithm)
        assert key.shard_seqlen == dispatch.shard_seqlen
        assert choice.overlap_degree >= 0 and choice.remote_kv_tokens_max >= 0
        assert choice.lower_bound_imbalance <= choice.imbalance + 1e-9
        # what the choice expects: the slowest rank's kernel times by the law, the planner's own
        assert choice.predicted_fwd_ms == alone.predicted_fwd_ms > 0
        assert choice.predicted_bwd_ms == alone.predicted_bwd_ms > 0
        if chunk is not None:
            assert choice.chunk_size == chunk and choice.algorithm == "min_heap"
        got.append(dataclasses.asdict(choice))
    # the documents placement asked for by name; a mask made after dispatch keeps it and reports its own times
    conf = cfg.DistAttnConfig(dispatch_config=cfg.DispatchConfig(alg="documents"))
    root = magi_attn_varlen_key(cu, cu, HQ, HKV, D, group, causal=True, dist_attn_config=conf)
    derived = make_varlen_key_for_new_mask_after_dispatch(cu, cu, root, causal=False)
    a, b = get_dispatch_choice(root), get_dispatch_choice(derived)
    assert a.algorithm == b.algorithm == "documents" and a.chunk_size == b.chunk_size
    assert derived.shard_seqlen == root.shard_seqlen
    assert b.predicted_bwd_ms > a.predicted_bwd_ms  # full documents cost more on the same placement
    got.append(dataclasses.asdict(b))
    mine = got
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    assert all(x == mine for x in everyone)  # the same choice on every rank
    clear_cache(group)
    return got


def test_get_dispatch_choice_on_ranks() -> None:
    assert magi_attention.get_dispatch_choice is get_dispatch_choice
    assert magi_attention.DispatchChoice is DispatchChoice
    results = run_distributed(_choice_worker, 2)
    assert results[0] == results[1]
    assert np.isfinite([r["imbalance"] for r in results[0]]).all()


def test_get_dispatch_choice_at_cp1() -> None:
    results = run_distributed(_cp1_worker, 1)
    (choice,) = results
    assert choice["chunk_size"] == 1000 and choice["imbalance"] == 1.0 and choice["remote_kv_tokens_max"] == 0


def _cp1_worker(rank: int, world_size: int) -> dict:
    key = magi_attn_varlen_key([0, 1000], [0, 1000], HQ, HKV, D, dist.group.WORLD, causal=True)
    out = dataclasses.asdict(get_dispatch_choice(key))
    clear_cache(dist.group.WORLD)
    return out
