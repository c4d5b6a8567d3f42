"""`magi_attention.testing.failure_checks` turns the always-on checks off inside its block only (restored on
the way out, exceptions included), and `failure_check_calls` runs each check alone. gloo, world 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import magi_attention.api as api
from magi_attention import config as cfg
from magi_attention.testing import failure_check_calls, failure_checks, run_distributed
from magi_group_collective.agreement import AgreementError

TOTAL, H, D = 48, 2, 8


def test_block_restores_the_checks_on_an_exception() -> None:
    import magi_group_collective._plan as grpcoll_plan

    before = api.agree_on_key, api.agree_on_call, grpcoll_plan._gather_tables
    with pytest.raises(RuntimeError, match="inside"):
        with failure_checks(call_agreement=False, key_fingerprint=False, table_check=False):
            assert api.agree_on_key is not before[0] and api.agree_on_call is not before[1]
            assert grpcoll_plan._gather_tables is not before[2]
            raise RuntimeError("inside")
    assert (api.agree_on_key, api.agree_on_call, grpcoll_plan._gather_tables) == before
    with failure_checks():  # all on: nothing swapped
        assert (api.agree_on_key, api.agree_on_call, grpcoll_plan._gather_tables) == before


def _worker(rank: int, world: int) -> list[str]:
    conf = cfg.DistAttnConfig(dispatch_config=cfg.DispatchConfig(chunk_size=4), kernel_backend="torch")
    key = api.magi_attn_flex_key(
        [[0, TOTAL]], [[0, TOTAL]], "causal", TOTAL, TOTAL, H, H, D, dist.group.WORLD, conf
    )
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        api.dispatch(torch.randn(TOTAL, H, D, generator=g, dtype=torch.float64), key) for _ in range(3)
    )
    calls = failure_check_calls(key, q, k, v)
    for name in ("key_fingerprint", "call_agreement", "local_checks", "device_plan"):
        calls[name]()
    with failure_checks(table_check=False):
        calls["device_plan"]()
    softcap = 1.0 + rank  # values that differ across ranks: the agreement refuses them
    with pytest.raises(AgreementError, match="softcap"):
        api.calc_attn(q, k, v, key, softcap=softcap)
    with failure_checks(call_agreement=False):
        out, _ = api.calc_attn(q, k, v, key, softcap=softcap)
    assert out.shape == q.shape and torch.isfinite(out).all()
    with pytest.raises(AgreementError, match="softcap"):  # back on after the block
        api.calc_attn(q, k, v, key, softcap=softcap)
    return sorted(calls)


def test_checks_switch_off_and_run_alone() -> None:
    names = run_distributed(_worker, 2, timeout=120)
    assert names == [["call_agreement", "device_plan", "key_fingerprint", "local_checks"]] * 2
