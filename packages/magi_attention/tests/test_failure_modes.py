"""Failure modes on gloo ranks (world 2 and 3): what disagrees across ranks, what is wrong on one rank, a
stalled peer, the plan cache's bounds, a plan too large for memory, a tensor used with the wrong key.

Every case ends in an error on every rank (naming the argument, the part of the key or the ranks), never in
a hang, a silent wrong result or an abort; `run_distributed` bounds each run.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from magi_attention import config as cfg
from magi_attention._runtime.cache import RUNTIME_CACHE, RuntimeCache
from magi_attention.api import (
    calc_attn,
    clear_cache,
    dispatch,
    magi_attn_flex_key,
    magi_attn_varlen_key,
    make_flex_key_for_new_mask_after_dispatch,
    undispatch,
)
from magi_attention.env import runtime_cache_bytes, runtime_dict_size
from magi_attention.testing import run_distributed

TOTAL, HQ, HKV, D = 48, 2, 1, 8
WAIT = 90.0


def _config() -> cfg.DistAttnConfig:
    return cfg.DistAttnConfig(
        dispatch_config=cfg.DispatchConfig(chunk_size=4),
        overlap_config=cfg.OverlapConfig(degree=1, min_chunk_size=4),
    )


def _key(mask_type="causal", total=TOTAL, hq=HQ, group=None, **kw):
    group = dist.group.WORLD if group is None else group
    return magi_attn_flex_key(
        [[0, total]], [[0, total]], mask_type, total, total, hq, HKV, D, group, _config(), **kw
    )


def _qkv(key, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(TOTAL, h, D, generator=g, dtype=dtype) for h in (HQ, HKV, HKV)]
    return [dispatch(t, key) for t in x]


def _raises(exc_type, match, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


# -- keys that differ across ranks: caught when the key is built (always on) -----------------------------
def _key_disagreement_worker(rank: int, world: int) -> None:
    last = world - 1
    # mask: causal on the last rank, full on the others
    msg = _raises(ValueError, "mask", _key, "causal" if rank == last else "full")
    assert f"ranks [{last}]" in msg, msg
    # heads
    msg = _raises(ValueError, "heads", _key, hq=4 if rank == last else 2)
    # sizes (a mask over the first 40 tokens on one rank, 48 on the others)
    _raises(ValueError, "sizes", _key, total=40 if rank == last else TOTAL)
    # config
    other = cfg.DistAttnConfig(dispatch_config=cfg.DispatchConfig(chunk_size=8))
    conf = other if rank == last else _config()
    _raises(
        ValueError,
        "dist_attn_config",
        magi_attn_flex_key,
        [[0, TOTAL]], [[0, TOTAL]], "causal", TOTAL, TOTAL, HQ, HKV, D, dist.group.WORLD, conf,
    )  # fmt: skip
    # deterministic mode on one rank only: set in the config, or through the environment variable
    det = dataclasses.replace(_config(), deterministic=rank == last)
    msg = _raises(
        ValueError,
        "deterministic",
        magi_attn_flex_key,
        [[0, TOTAL]], [[0, TOTAL]], "causal", TOTAL, TOTAL, HQ, HKV, D, dist.group.WORLD, det,
    )  # fmt: skip
    assert f"ranks [{last}]" in msg and "dist_attn_config" not in msg, msg
    os.environ["MAGI_ATTENTION_DETERMINISTIC_MODE"] = "1" if rank == last else "0"
    try:
        _raises(ValueError, "deterministic", _key, "causal")  # _config() is built after the variable is set
    finally:
        del os.environ["MAGI_ATTENTION_DETERMINISTIC_MODE"]
    # pad_size passed differently
    _raises(ValueError, "pad_size", _key, pad_size=0 if rank == last else None)
    # the environment choosing different group collectives (native buffers on one rank, all-to-all-v on the
    # others would cross collectives later)
    os.environ["MAGI_ATTENTION_NATIVE_GRPCOLL"] = "1" if rank == last else "0"
    try:
        _raises(ValueError, "group-collective implementation", _key, "causal")
    finally:
        del os.environ["MAGI_ATTENTION_NATIVE_GRPCOLL"]
    # a key made after dispatch with a different mask on one rank
    base = _key("full")
    _raises(
        ValueError,
        "mask",
        make_flex_key_for_new_mask_after_dispatch,
        [[0, 24 if rank == last else 16]], [[0, TOTAL]], "full", base,
    )  # fmt: skip
    # and afterwards everything still works (nothing was left half-agreed)
    key = _key("causal")
    q, k, v = _qkv(key)
    out, _ = calc_attn(q, k, v, key)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("world", [2, 3])
def test_keys_that_differ_across_ranks_raise_on_every_rank(world):
    run_distributed(_key_disagreement_worker, world, timeout=WAIT)


def _key_error_on_one_rank_worker(rank: int, world: int) -> None:
    if rank == 1:  # a bad argument on one rank only: it raises its own error
        _raises(ValueError, "num_heads_q", _key, hq=0)
        _raises(ValueError, "q_ranges", magi_attn_flex_key, [[0, 99]], [[0, 8]], "full", TOTAL, TOTAL,
                HQ, HKV, D, dist.group.WORLD)  # fmt: skip
        _raises(ValueError, "cu_seqlens_q", magi_attn_varlen_key, [0, 8.5], [0, 8.5], HQ, HKV, D,
                dist.group.WORLD)  # fmt: skip
    else:  # ... and the others are told instead of waiting for it in dispatch / calc_attn
        for _ in range(2):
            _raises(ValueError, r"rank\(s\) \[1\] rejected their input", _key)
        _raises(ValueError, r"rank\(s\) \[1\]", magi_attn_varlen_key, [0, TOTAL], [0, TOTAL], HQ, HKV, D,
                dist.group.WORLD)  # fmt: skip
    key = _key("causal")  # in step again
    out, _ = calc_attn(*_qkv(key), key)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("world", [2, 3])
def test_key_error_on_one_rank_reaches_every_rank(world):
    run_distributed(_key_error_on_one_rank_worker, world, timeout=WAIT)


def _cache_hits_are_collective_free_worker(rank: int, world: int) -> int:
    key = _key("causal")
    # only rank 0 rebuilds the (cached) key many times: a hit must not enter any collective
    if rank == 0:
        for _ in range(5):
            assert _key("causal") == key
    out, _ = calc_attn(*_qkv(key), key)
    return int(torch.isfinite(out).all())


def test_cache_hits_are_collective_free():
    assert run_distributed(_cache_hits_are_collective_free_worker, 2, timeout=WAIT) == [1, 1]


# -- per-call arguments: validated before any communication; agreed across ranks in sanity mode ---------
def _bad_call_args_worker(rank: int, world: int) -> None:
    key = _key("causal")
    q, k, v = _qkv(key)
    for kwargs, words in (
        ({"softmax_scale": True}, "softmax_scale"),
        ({"softmax_scale": float("inf")}, "softmax_scale"),
        ({"softmax_scale": float("nan")}, "softmax_scale"),
        ({"softmax_scale": 1e300}, "softmax_scale"),
        ({"softmax_scale": "0.5"}, "softmax_scale"),
        ({"softcap": float("inf")}, "softcap"),
        ({"softcap": True}, "softcap"),
        ({"softcap": -1.0}, "softcap"),
    ):
        _raises(ValueError, words, calc_attn, q, k, v, key, **kwargs)
    _raises(TypeError, "float16, bfloat16, float32 or float64", calc_attn, q.long(), k.long(), v.long(), key)
    _raises(TypeError, "DistAttnRuntimeKey", calc_attn, q, k, v, "key")
    out, _ = calc_attn(q, k, v, key)  # nothing was left in flight
    assert torch.isfinite(out).all()


def test_bad_call_arguments_raise_before_any_communication():
    run_distributed(_bad_call_args_worker, 2, timeout=WAIT)


def _sanity_worker(rank: int, world: int, sanity: str) -> None:
    os.environ["MAGI_ATTENTION_SANITY_CHECK"] = sanity  # what sanity mode caught is now always caught
    last = world - 1
    key = _key("causal")
    q, k, v = _qkv(key)
    # a bad scalar on one rank: every rank raises, the bad one with its own message
    bad = {"softcap": float("inf")} if rank == last else {}
    _raises(ValueError, "softcap" if rank == last else "other rank", calc_attn, q, k, v, key, **bad)
    bad = {"softmax_scale": True} if rank == last else {}
    _raises(ValueError, "softmax_scale" if rank == last else "other rank", calc_attn, q, k, v, key, **bad)
    # a wrong dtype on one rank
    qb, kb, vb = (t.long() for t in (q, k, v)) if rank == last else (q, k, v)
    _raises(TypeError if rank == last else ValueError, "float16" if rank == last else "other rank",
            calc_attn, qb, kb, vb, key)  # fmt: skip
    # valid but different values: named with the ranks
    msg = _raises(ValueError, "softmax_scale", calc_attn, q, k, v, key, softmax_scale=0.1 * (rank + 1))
    assert "ranks [0]" in msg, msg
    qf, kf, vf = (t.float() for t in (q, k, v)) if rank == last else (q, k, v)
    _raises(ValueError, "q.dtype", calc_attn, qf, kf, vf, key)
    # dispatch of tensors with different trailing shapes (its backward would gather mismatched rows)
    _raises(ValueError, "shape", dispatch, torch.zeros(TOTAL, 2 + (rank == last)), key)
    # ranks in different calls
    x = torch.zeros(TOTAL, 3)
    local = dispatch(x, key)
    if rank == last:
        _raises(ValueError, "different calls", undispatch, local, key)
    else:
        _raises(ValueError, "different calls", dispatch, x, key)
    out, _ = calc_attn(q, k, v, key)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("sanity", ["1", "0"])
@pytest.mark.parametrize("world", [2, 3])
def test_call_arguments_agree_with_and_without_sanity_mode(world, sanity):
    run_distributed(_sanity_worker, world, sanity, timeout=WAIT)


def _sanity_key_hit_worker(rank: int, world: int) -> None:
    """Sanity mode's extra: key builds that hit the cache agree too, so a rank whose build fails is heard
    even when the others hit the cache (by default those communicate nothing)."""
    os.environ["MAGI_ATTENTION_SANITY_CHECK"] = "1"
    _key("causal")
    if rank == 1:
        _raises(ValueError, "num_heads_q", _key, hq=0)
    else:
        _raises(ValueError, r"rank\(s\) \[1\] rejected", _key, "causal")  # a cache hit, agreed anyway


def test_sanity_mode_agrees_on_key_cache_hits():
    run_distributed(_sanity_key_hit_worker, 2, timeout=WAIT)


# -- a stalled peer: the process group's timeout bounds the wait; the error names the call, the phase (and
# the stage, inside the data collectives) and the peer that did not report ---------------------------------
def _stalled_peer_worker(rank: int, world: int, phase: str, where: str) -> str:
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=4))
    key = _key("full", group=group)
    q, k, v = (t.requires_grad_() for t in _qkv(key))
    if rank == 1:
        if where == "inside":  # rank 1 agrees, then stalls before the first GroupCast of the phase
            import magi_attention.dist_attn as da

            real_start = da._KVFetcher.start

            def stalled_start(self, stage, *args, **kwargs):
                if self.phase == phase:
                    time.sleep(8)
                return real_start(self, stage, *args, **kwargs)

            da._KVFetcher.start = stalled_start
            try:
                with pytest.raises(RuntimeError):  # its peer gave up meanwhile
                    out, _ = calc_attn(q, k, v, key)
                    out.sum().backward()
            finally:
                da._KVFetcher.start = real_start
            return ""
        if phase == "backward":
            out, _ = calc_attn(q, k, v, key)  # forward together, then never run the backward
        time.sleep(8)
        return ""
    out, _ = calc_attn(q, k, v, key) if phase == "backward" else (None, None)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        if phase == "forward":
            calc_attn(q, k, v, key)
        else:
            out.sum().backward()
    assert time.monotonic() - t0 < 30
    return str(info.value)


@pytest.mark.parametrize("where", ["skipped", "inside"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_stalled_peer_error_names_call_phase_and_peer(phase, where):
    msgs = run_distributed(_stalled_peer_worker, 2, phase, where, timeout=WAIT)
    msg = msgs[0]
    assert "rank 0 of cp group" in msg and "rank(s) [1] did not report" in msg, msg
    if where == "skipped":  # rank 1 never reached the call: its status agreement names it
        assert f"the status agreement of calc_attn ({phase}) failed" in msg, msg
    else:  # rank 1 stalled after the agreement: the data collective of the phase names it
        assert f"in the {phase} of calc_attn" in msg, msg
        assert "stage 0" in msg and ("GroupCast" in msg or "GroupReduce" in msg), msg


# -- the wrong key for dispatched tensors ------------------------------------------------------------------
def _wrong_key_worker(rank: int, world: int) -> None:
    causal = _key("causal")
    window = magi_attn_flex_key([[0, 24], [24, TOTAL]], [[0, 24], [0, TOTAL]], "full", TOTAL, TOTAL,
                                HQ, HKV, D, dist.group.WORLD, _config())  # fmt: skip
    q, k, v = _qkv(causal)
    _raises(ValueError, "dispatched .* with another key", calc_attn, q, k, v, window)
    out, _ = calc_attn(q, k, v, causal)
    _raises(ValueError, "another key", undispatch, out, window)
    # a key made after dispatch shares the placement: allowed
    after = make_flex_key_for_new_mask_after_dispatch([[0, TOTAL]], [[0, TOTAL]], "full", causal)
    out2, _ = calc_attn(q, k, v, after)
    assert undispatch(out2, causal).shape[0] == TOTAL


def test_tensors_dispatched_with_another_key_are_rejected():
    run_distributed(_wrong_key_worker, 2, timeout=WAIT)


# -- plan size: fail at once, with the estimate ----------------------------------------------------------
def _huge_total_worker(rank: int, world: int) -> float:
    t0 = time.monotonic()
    with pytest.raises(MemoryError, match="GiB"):
        magi_attn_flex_key([[0, 8]], [[0, 8]], "full", 10**10, 10**10, HQ, HKV, D, dist.group.WORLD)
    return time.monotonic() - t0


def test_plan_too_large_for_memory_fails_at_once():
    times = run_distributed(_huge_total_worker, 2, timeout=WAIT)
    assert max(times) < 2.0, times


# -- cache bounds -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", ["-1", "0", "abc", "1.5"])
def test_bad_cache_size_env_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", raw)
    with pytest.raises(ValueError, match=r"MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE.*positive integer"):
        runtime_dict_size()
    monkeypatch.setenv("MAGI_ATTENTION_RUNTIME_CACHE_MB", raw)
    with pytest.raises(ValueError, match="MAGI_ATTENTION_RUNTIME_CACHE_MB"):
        runtime_cache_bytes()


def _cache_bounds_worker(rank: int, world: int) -> None:
    clear_cache()
    cache = RUNTIME_CACHE
    assert isinstance(cache, RuntimeCache)
    os.environ["MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE"] = "2"
    roots = [_key("full", total=TOTAL - 4 * i) for i in range(2)]
    # keys made after dispatch share their root's layout; evicting all of them frees it
    for i in range(4):
        make_flex_key_for_new_mask_after_dispatch([[0, 8 + i]], [[0, 8]], "full", roots[0])
    assert len(cache._layouts) <= 2 and len(cache._layout_refs) <= 2, cache._layouts.keys()
    for i in range(3, 6):
        _key("causal", total=TOTAL - 4 * i)
    assert len(cache._layouts) == 2, len(cache._layouts)  # no layout of an evicted root is kept
    assert sum(cache._layout_refs.values()) == 2
    # byte bound: a 1 MiB budget keeps only what fits (the newest always stays)
    os.environ["MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE"] = "1000"
    os.environ["MAGI_ATTENTION_RUNTIME_CACHE_MB"] = "1"
    group = dist.group.WORLD.group_name
    big = cfg.DistAttnConfig(dispatch_config=cfg.DispatchConfig(chunk_size=1024))
    for i in range(3):
        n = 32768 + 2048 * i
        magi_attn_flex_key([[0, n]], [[0, n]], "full", n, n, HQ, HKV, D, dist.group.WORLD, big)
        assert len(cache._by_group[group]) == 1  # each entry is over half the 1 MiB budget
    entry = next(iter(cache._by_group[group].values()))
    assert entry.nbytes > 32768 * 8 * 2  # at least the permutation of every token and its inverse
    assert cache.nbytes(group) == sum(r.nbytes for r in cache._by_group[group].values())
    clear_cache()
    assert not cache._layouts and not cache._layout_refs and cache.nbytes(group) == 0


def test_cache_is_bounded_by_entries_and_bytes_and_frees_layouts():
    run_distributed(_cache_bounds_worker, 2, timeout=WAIT)
