"""The status agreement of every public collective call (no sanity mode needed): a rank that rejects its
own input, or passes values the others do not, or makes another call, makes every rank raise at once
(within 2 s, never the process group's timeout), naming the call and the rank(s); a rank that stays alive
after its error (try/except) is in step again at its next call. gloo, world 2 and 3."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from magi_attention import config as cfg
from magi_attention.api import calc_attn, clear_cache, dispatch, magi_attn_flex_key, roll, undispatch
from magi_attention.testing import run_distributed
from magi_group_collective.agreement import AgreementError

TOTAL, HQ, HKV, D = 48, 2, 1, 8
FAST = 2.0  # seconds: every rank must raise within this (the group timeout is far longer)
WAIT = 120.0


def _key(group=None):
    conf = cfg.DistAttnConfig(
        dispatch_config=cfg.DispatchConfig(chunk_size=4),
        overlap_config=cfg.OverlapConfig(degree=1, min_chunk_size=4),
    )
    group = dist.group.WORLD if group is None else group
    return magi_attn_flex_key([[0, TOTAL]], [[0, TOTAL]], "causal", TOTAL, TOTAL, HQ, HKV, D, group, conf)


def _qkv(key, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [dispatch(torch.randn(TOTAL, h, D, generator=g, dtype=dtype), key) for h in (HQ, HKV, HKV)]


def _timed(exc_type, match, fn, *args, **kwargs) -> str:
    t0 = time.monotonic()
    with pytest.raises(exc_type, match=match) as info:
        fn(*args, **kwargs)
    took = time.monotonic() - t0
    assert took < FAST, f"took {took:.1f} s: {info.value}"
    return str(info.value)


def _one_rank_wrong(rank: int, bad: int, own: tuple, call: str, fn, *args, **kwargs) -> None:
    """Rank `bad` raises its own error; every other rank an AgreementError naming the call and rank `bad`."""
    if rank == bad:
        _timed(own[0], own[1], fn, *args, **kwargs)
    else:
        msg = _timed(AgreementError, rf"rank\(s\) \[{bad}\] rejected", fn, *args, **kwargs)
        assert call in msg, msg


def _cases_worker(rank: int, world: int) -> int:
    last = world - 1
    key = _key()
    q, k, v = _qkv(key)
    x = torch.randn(TOTAL, 3, dtype=torch.float64)
    n = 0
    # -- one rank rejects its own input: everyone raises, in every public call --------------------------
    bad_x = x[:-1] if rank == last else x
    _one_rank_wrong(rank, last, (ValueError, "tokens on dim 0"), "dispatch", dispatch, bad_x, key)
    qs = q[:-1] if rank == last else q
    _one_rank_wrong(rank, last, (ValueError, "tokens"), "calc_attn (forward)", calc_attn, qs, k, v, key)
    qi, ki, vi = (t.long() for t in (q, k, v)) if rank == last else (q, k, v)
    _one_rank_wrong(rank, last, (TypeError, "float16"), "calc_attn (forward)", calc_attn, qi, ki, vi, key)
    _one_rank_wrong(rank, last, (ValueError, "softcap"), "calc_attn (forward)", calc_attn, q, k, v, key,
                    softcap=-1.0 if rank == last else 0.0)  # fmt: skip
    local = dispatch(x, key)
    bad_local = local[:-1] if rank == last else local
    _one_rank_wrong(rank, last, (ValueError, "local_x"), "undispatch", undispatch, bad_local, key)
    _one_rank_wrong(rank, last, (ValueError, "dim"), "roll", roll, local, 1, 5 if rank == last else 0, key)
    n += 6
    # -- valid values that differ across ranks: named, with the ranks on each side (gloo would abort) ---------
    qf, kf, vf = (t.float() for t in (q, k, v)) if rank == last else (q, k, v)
    msg = _timed(AgreementError, r"`q\.dtype` differs", calc_attn, qf, kf, vf, key)
    assert f"ranks [{last}]: torch.float32" in msg, msg
    _timed(AgreementError, "softmax_scale", calc_attn, q, k, v, key, softmax_scale=0.1 * (rank + 1))
    _timed(AgreementError, "x.shape", dispatch, torch.zeros(TOTAL, 2 + (rank == last)), key)
    _timed(AgreementError, "shift", roll, local, 1 + rank, 0, key)
    n += 4
    # -- ranks in different calls (a skipped dispatch, a skipped backward): told, not left waiting --------
    if rank == last:
        _timed(AgreementError, "different calls", undispatch, local, key)
    else:
        _timed(AgreementError, "different calls", dispatch, x, key)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = calc_attn(qg, kg, vg, key)
    if rank == last:  # skips the backward and calls the next forward
        _timed(AgreementError, "different calls", calc_attn, q, k, v, key)
    else:
        msg = _timed(AgreementError, "different calls", out.sum().backward)
        assert "calc_attn (backward)" in msg and "calc_attn (forward)" in msg, msg
    n += 2
    # -- clear_cache on one rank only: every rank raises, nothing is cleared, the next call works ---------
    if rank == 0:
        _timed(AgreementError, "different calls", clear_cache)
    else:
        _timed(AgreementError, "different calls", calc_attn, q, k, v, key)
    assert key in __import__("magi_attention._runtime.cache", fromlist=["RUNTIME_CACHE"]).RUNTIME_CACHE
    # ... and on every rank: collective, then the key is planned again together
    clear_cache()
    key = _key()
    q, k, v = (t.requires_grad_() for t in _qkv(key))
    out, _ = calc_attn(q, k, v, key)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    n += 2
    return n


@pytest.mark.parametrize("world", [2, 3])
def test_every_public_call_agrees_before_any_data_moves(world):
    assert run_distributed(_cases_worker, world, timeout=WAIT) == [14] * world


def _dead_peer_worker(rank: int, world: int) -> str:
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=20))
    key = _key(group)
    q, k, v = _qkv(key)
    if rank == 1:  # dies (its connections close) instead of calling calc_attn
        dist.destroy_process_group(group)
        return ""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        calc_attn(q, k, v, key)
    assert time.monotonic() - t0 < 10, time.monotonic() - t0  # the connection closed: no timeout to wait for
    return str(info.value)


def test_a_dead_peer_is_named_by_the_survivors():
    msg = run_distributed(_dead_peer_worker, 2, timeout=WAIT)[0]
    assert "rank 0 of cp group" in msg and "status agreement of calc_attn (forward)" in msg, msg
    assert "rank(s) [1] did not report" in msg, msg
