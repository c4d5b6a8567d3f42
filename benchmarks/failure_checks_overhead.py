"""Cost of the always-on failure checks (docs/failure_modes.md), CPU gloo, world 2.

- key creation on a cache miss, with and without the key-fingerprint all-gather (the plan is built in
  both), and on a cache hit (collective-free);
- the GroupCast/GroupReduce table check at plan construction (once per key and device);
- calc_attn's extra local checks (scalars, dtype, dispatch tags) in microseconds per call.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/failure_checks_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import magi_attention._fingerprint as fp
import magi_attention.api as api
from magi_attention import config as cfg
from magi_attention._call_checks import check_dtype, check_scalars
from magi_attention._dispatch_tags import check_dispatch_tags
from magi_attention._runtime import RUNTIME_CACHE
from magi_attention.testing import run_distributed

TOTAL = 32768
DOCS = [0, 4096, 12288, 16384, 24576, TOTAL]


def _median_us(fn, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _worker(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    conf = cfg.DistAttnConfig(dispatch_config=cfg.DispatchConfig(chunk_size=512))
    out = {}

    def build(shift):
        cu = [0] + [c + shift for c in DOCS[1:-1]] + [TOTAL]
        return api.magi_attn_varlen_key(cu, cu, 32, 32, 128, group, causal=True, dist_attn_config=conf)

    for label, patch in (("miss_with_fingerprint", False), ("miss_without_fingerprint", True)):
        real = fp.agree_on_key
        if patch:
            api.agree_on_key = lambda *a, **k: None
        times = []
        for i in range(20):
            dist.barrier()
            api.clear_cache()
            t0 = time.perf_counter()
            build(i + 1)
            times.append((time.perf_counter() - t0) * 1e3)
        api.agree_on_key = real
        out[label + "_ms"] = statistics.median(times)
    key = build(1)
    dist.barrier()
    out["hit_us"] = _median_us(lambda: build(1), 200)
    dist.barrier()
    # the fingerprint exchange alone (one all-gather of 8 int64)
    out["fingerprint_exchange_us"] = _median_us(lambda: fp.agree_on_key(key, False), 50)
    # table check at plan construction: device meta built with it (default) ...
    runtime = RUNTIME_CACHE.get(key)
    times = []
    for _ in range(10):
        runtime._device_meta.clear()
        dist.barrier()
        t0 = time.perf_counter()
        runtime.device_meta(torch.device("cpu"))
        times.append((time.perf_counter() - t0) * 1e3)
    out["device_meta_with_table_check_ms"] = statistics.median(times)
    import magi_group_collective._plan as gplan

    real_gather = gplan._gather_tables
    gplan._gather_tables = lambda *a, **k: None
    times = []
    for _ in range(10):
        runtime._device_meta.clear()
        dist.barrier()
        t0 = time.perf_counter()
        runtime.device_meta(torch.device("cpu"))
        times.append((time.perf_counter() - t0) * 1e3)
    gplan._gather_tables = real_gather
    out["device_meta_without_table_check_ms"] = statistics.median(times)
    # calc_attn's extra local checks
    shard = runtime.layout.shard_seqlen
    q = api.dispatch(torch.zeros(TOTAL, 32, 128, dtype=torch.bfloat16), key)
    k = v = q

    def checks():
        check_dtype(q)
        check_scalars(None, 0.0, 128)
        check_dispatch_tags(runtime, q=q, k=k, v=v)

    out["calc_attn_extra_checks_us"] = _median_us(checks, 2000)
    out["shard"] = shard
    return out


if __name__ == "__main__":
    results = run_distributed(_worker, 2, timeout=600)
    for r, res in enumerate(results):
        print(
            f"rank {r}: "
            + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())
        )
