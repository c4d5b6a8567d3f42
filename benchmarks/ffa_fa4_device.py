"""One H200 session for magi-ffa-fa4: GPU tests, metadata timing, host overhead, kernel benchmark.

Usage (on the GPU machine, after the FA4 wheels are installed; see docs/benchmarks/ffa_fa4.md):
    PYTHONPATH=packages/ffa_fa4/src python3 benchmarks/ffa_fa4_device.py --out $OUT [--budget-s 330]

Sections run in order of importance and are skipped once the time budget is spent; every section catches
its own errors, so one failure never hides the others. Rows go to OUT/ffa_fa4_rows.json, a table to stdout.
TFLOP/s use the masked area (FLOPs fwd = 4 * area * heads_q * head_dim, bwd = 2.5 x fwd; bwd time =
(fwd + bwd) - fwd), `triton.testing.do_bench` medians, random bf16 inputs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
import traceback
from functools import partial

os.environ["TRITON_INTERPRET"] = "0"  # the package's conftest would turn the interpreter on otherwise
os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/tmp/fa4_cache")

import torch

T0 = time.time()
ROWS: list[dict] = []


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def doc_lengths(total: int, seed: int = 0, cap_frac: float = 0.25) -> list[int]:
    """Log-normal document lengths around total/16 (sigma 1), each at most total/4 (as the anchor bench)."""
    rng, lens, left = random.Random(seed), [], total
    while left > 0:
        n = min(left, int(total * cap_frac), max(16, int(rng.lognormvariate(math.log(total / 16), 1.0))))
        lens.append(n)
        left -= n
    return lens


def mask_slices(name: str, total: int, seed: int = 0):
    """(q_ranges, k_ranges, types) as int32 CUDA tensors for a named mask family."""
    lens = doc_lengths(total, seed)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    if name == "full":
        qr, kr, tm = [[0, total]], [[0, total]], [0]
    elif name == "causal":
        qr, kr, tm = [[0, total]], [[0, total]], [1]
    elif name in ("varlen_full", "varlen_causal"):
        qr = [[s, s + n] for s, n in zip(starts, lens)]
        kr, tm = qr, [1 if name == "varlen_causal" else 0] * len(qr)
    elif name.startswith("swa_causal_w"):
        w = int(name.removeprefix("swa_causal_w"))
        qr, kr, tm = [[0, w], [w, total]], [[0, w], [1, total]], [1, 3]
    elif name == "varlen_block_causal":
        qr, kr = [], []
        for s, n in zip(starts, lens):
            for b in range(s, s + n, 2048):
                qr.append([b, min(b + 2048, s + n)])
                kr.append([s, min(b + 2048, s + n)])
        tm = [0] * len(qr)
    elif name == "random_slices":
        rng = random.Random(seed)
        qr, kr, tm = [], [], []
        for _ in range(64):
            a = rng.randrange(total - 512)
            b = min(total, a + rng.randrange(512, total // 8))
            c = rng.randrange(total - 512)
            e = min(total, c + rng.randrange(512, total // 8))
            qr.append([a, b])
            kr.append([c, e])
            tm.append(rng.randrange(4))
    else:
        raise ValueError(name)
    dev = torch.device("cuda")
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    return t(qr).reshape(-1, 2), t(kr).reshape(-1, 2), t(tm), lens


def section_intervals_check() -> None:
    """Triton interval kernel (compiled, on the GPU) against the torch reference on random masks."""
    from magi_ffa.intervals import row_intervals, row_intervals_reference
    from magi_ffa_fa4.blocks import build_block_meta

    rng = random.Random(1)
    for trial in range(20):
        tq, tk = rng.randrange(1, 5000), rng.randrange(1, 5000)
        n = rng.randrange(0, 40)
        qr = [sorted(rng.randrange(tq + 1) for _ in range(2)) for _ in range(n)]
        kr = [sorted(rng.randrange(tk + 1) for _ in range(2)) for _ in range(n)]
        tm = [rng.randrange(4) for _ in range(n)]
        dev = torch.device("cuda")
        args = (
            torch.tensor(qr, dtype=torch.int32, device=dev).reshape(-1, 2),
            torch.tensor(kr, dtype=torch.int32, device=dev).reshape(-1, 2),
            torch.tensor(tm, dtype=torch.int32, device=dev),
            tq,
            tk,
        )
        a = row_intervals(*args, use_triton=True)
        b = row_intervals_reference(*args)
        assert a.width == b.width and torch.equal(a.starts, b.starts) and torch.equal(a.ends, b.ends), trial
        ma, mb = build_block_meta(a, 128, 128), build_block_meta(b, 128, 128)
        assert torch.equal(ma.q2k.mask_idx, mb.q2k.mask_idx) and torch.equal(ma.k2q.full_idx, mb.k2q.full_idx)
    ROWS.append({"section": "intervals_check", "ok": True, "trials": 20})
    log("intervals: Triton on GPU == torch reference on 20 random masks")


def _pytest(out_dir: str, tag: str) -> int:
    import pytest

    args = ["-q", "-p", "no:warnings", "-p", "no:cacheprovider", "-o", "addopts=", "--durations=0"]
    args += [f"--junitxml={out_dir}/gpu_tests_{tag}.xml", "packages/ffa_fa4/tests/test_fa4_gpu.py"]
    return int(pytest.main(args))


def section_tests(out_dir: str) -> None:
    """GPU tests with the row-bitmask path; if they fail, again with the per-element mask_mod (and keep it)."""
    from magi_ffa_fa4 import clear_plan_cache
    from magi_ffa_fa4._launch_meta import r2p_enabled

    tag = "r2p" if r2p_enabled() else "mask_mod"
    rc = _pytest(out_dir, tag)
    ROWS.append({"section": "gpu_tests", "mode": tag, "rc": rc})
    log(f"GPU tests ({tag}) exit code {rc}")
    if rc != 0 and tag == "r2p":
        os.environ["MAGI_FFA_FA4_R2P"] = "0"
        clear_plan_cache()
        rc = _pytest(out_dir, "mask_mod")
        ROWS.append({"section": "gpu_tests", "mode": "mask_mod", "rc": rc})
        log(f"GPU tests (mask_mod fallback) exit code {rc}")


def _timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def section_metadata(total: int) -> None:
    from magi_ffa.intervals import row_intervals
    from magi_ffa_fa4._launch_meta import build_launch_meta, tile_sizes
    from magi_ffa_fa4.blocks import build_block_meta

    dev = torch.device("cuda")
    (bm, bn), _ = tile_sizes(dev)
    for name in ("varlen_causal", "varlen_block_causal", "swa_causal_w4096", "causal", "full"):
        qr, kr, tm, _ = mask_slices(name, total)
        iv = row_intervals(qr, kr, tm, total, total)
        t_iv = _timed(partial(row_intervals, qr, kr, tm, total, total))
        t_meta = _timed(partial(build_block_meta, iv, bm, bn))
        t_plan = _timed(partial(build_launch_meta, qr, kr, tm, total, total, dev))
        meta = build_block_meta(iv, bm, bn)
        r = {
            "section": "metadata",
            "mask": name,
            "tokens": total,
            "slices": int(qr.shape[0]),
            "width": iv.width,
            "full_tiles": int(meta.q2k.full_idx.numel()),
            "partial_tiles": int(meta.q2k.mask_idx.numel()),
            "intervals_ms": round(t_iv, 3),
            "classify_lists_ms": round(t_meta, 3),
            "plan_total_ms": round(t_plan, 3),
        }
        ROWS.append(r)
        log(json.dumps(r))
        torch.cuda.empty_cache()


def section_overhead() -> None:
    """Host time per repeated call (same mask) of ours vs FA4's raw call with the same prebuilt arguments."""
    from flash_attn.cute import interface as fa

    import magi_ffa_fa4
    from magi_ffa_fa4._launch_meta import get_launch_meta

    dev, total = torch.device("cuda"), 2048
    qr, kr, tm, _ = mask_slices("varlen_causal", total)
    q = torch.randn(total, 8, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(total, 8, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    plan = get_launch_meta(qr, kr, tm, total, total, dev)
    scale = 128**-0.5

    def ours():
        magi_ffa_fa4.flex_flash_attn_func(q, k, v, qr, kr, tm)

    def raw():
        fa._flash_attn_fwd(
            q[None],
            k[None],
            v[None],
            softmax_scale=scale,
            mask_mod=plan.mask_mod,
            block_sparse_tensors=plan.fwd_bst,
            aux_tensors=[plan.bounds],
            return_lse=True,
        )

    def plan_hit():
        get_launch_meta(qr, kr, tm, total, total, dev)

    res = {}
    with torch.no_grad():
        for nm, fn in (("ours", ours), ("raw_fa4", raw), ("plan_lookup", plan_hit)):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            best = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(100):
                    fn()
                best.append((time.perf_counter() - t) / 100 * 1e6)
                torch.cuda.synchronize()
            res[nm] = round(min(best), 1)
    r = {"section": "host_overhead_us", **res, "added_by_magi": round(res["ours"] - res["raw_fa4"], 1)}
    ROWS.append(r)
    log(json.dumps(r))


def _bench_pair(fwd, q, k, v, flops: float) -> tuple[float, float]:
    from triton.testing import do_bench

    with torch.no_grad():
        tf = do_bench(fwd, warmup=25, rep=100, return_mode="median")
    o = fwd()
    o = o[0] if isinstance(o, tuple) else o
    g = torch.randn_like(o)

    def fb():
        r = fwd()
        r = r[0] if isinstance(r, tuple) else r
        torch.autograd.grad(r, (q, k, v), g)

    tfb = do_bench(fb, warmup=25, rep=100, return_mode="median")
    return round(flops / tf / 1e9, 1), round(2.5 * flops / (tfb - tf) / 1e9, 1)


def section_bench(total: int, hq: int, hk: int, d: int, masks: list[str], deadline: float) -> None:
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    import magi_ffa_fa4
    from magi_ffa.intervals import row_intervals

    dev = torch.device("cuda")
    q = torch.randn(total, hq, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for name in masks:
        if time.time() > deadline:
            log(f"budget spent: skipping {name}")
            continue
        qr, kr, tm, lens = mask_slices(name, total)
        iv = row_intervals(qr, kr, tm, total, total)
        area = int((iv.ends - iv.starts).clamp(min=0).sum())
        flops = 4.0 * area * hq * d
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        kernels = {
            "ffa_fa4": lambda qr=qr, kr=kr, tm=tm: magi_ffa_fa4.flex_flash_attn_func(q, k, v, qr, kr, tm)
        }
        q4, k4, v4 = q[None], k[None], v[None]
        if name == "full":
            kernels["fa4"] = partial(flash_attn_func, q4, k4, v4)
        elif name == "causal":
            kernels["fa4"] = partial(flash_attn_func, q4, k4, v4, causal=True)
        elif name in ("varlen_full", "varlen_causal"):
            m = max(lens)
            kernels["fa4"] = partial(
                flash_attn_varlen_func,
                q,
                k,
                v,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=m,
                max_seqlen_k=m,
                causal=name == "varlen_causal",
            )
        elif name.startswith("swa_causal_w"):
            w = int(name.removeprefix("swa_causal_w"))
            kernels["fa4"] = partial(flash_attn_func, q4, k4, v4, causal=True, window_size=(w - 1, 0))
        else:
            kernels["flex"] = _flex_kernel(q, k, v, iv)
        for kname, fn in kernels.items():
            try:
                fwd_tf, bwd_tf = _bench_pair(fn, q, k, v, flops)
                r = {"kernel": kname, "mask": name, "S": total, "hq": hq, "hk": hk, "d": d, "area": area}
                if kname == "ffa_fa4":
                    r["r2p"] = os.environ.get("MAGI_FFA_FA4_R2P", "1") != "0"
                r.update(fwd_tflops=fwd_tf, bwd_tflops=bwd_tf)
            except Exception as e:  # one kernel failing must not hide the others
                r = {"kernel": kname, "mask": name, "error": repr(e)[:400]}
                traceback.print_exc()
            ROWS.append({"section": "bench", **r})
            log(json.dumps(r))
        torch.cuda.empty_cache()


def _flex_kernel(q, k, v, iv):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.recompile_limit = 64
    st, en, width = iv.starts, iv.ends, iv.width

    def mask_mod(b, h, qi, ki):
        hit = (ki >= st[qi, 0]) & (ki < en[qi, 0])
        for i in range(1, width):
            hit = hit | ((ki >= st[qi, i]) & (ki < en[qi, i]))
        return hit

    total = q.shape[0]
    bm = create_block_mask(mask_mod, 1, 1, total, total, device="cuda")
    flex = torch.compile(flex_attention)
    return lambda: flex(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        block_mask=bm,
        enable_gqa=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--budget-s", type=float, default=330.0)
    ap.add_argument("--sections", default="check,tests,metadata,overhead,bench")
    ap.add_argument(
        "--masks",
        default="full,causal,varlen_causal,swa_causal_w1024,varlen_block_causal,random_slices",
        help="benchmark masks (32k tokens, 64:8 heads, d 128)",
    )
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    deadline = T0 + a.budget_s
    import flash_attn.cute  # noqa: F401  (fail early when FA4 is missing)
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flash_attn_4": "4.0.0b36 (wheel)",
    }
    log(json.dumps(env))
    ROWS.append({"section": "env", **env})
    secs = a.sections.split(",")
    plan = [
        ("check", section_intervals_check, ()),
        ("tests", section_tests, (a.out,)),
        ("metadata", section_metadata, (1 << 20,)),
        ("overhead", section_overhead, ()),
        (
            "bench",
            section_bench,
            (
                32768,
                64,
                8,
                128,
                a.masks.split(","),
                deadline,
            ),
        ),
    ]
    for name, fn, args in plan:
        if name not in secs:
            continue
        if time.time() > deadline:
            log(f"budget spent: skipping section {name}")
            continue
        log(f"=== {name}")
        try:
            fn(*args)
        except Exception as e:
            traceback.print_exc()
            ROWS.append({"section": name, "error": repr(e)[:400]})
        with open(os.path.join(a.out, "ffa_fa4_rows.json"), "w") as f:
            json.dump(ROWS, f, indent=1)
    print("\n| kernel | mask | fwd TFLOP/s | bwd TFLOP/s |")
    print("|---|---|---|---|")
    for r in ROWS:
        if r.get("section") == "bench":
            print(
                f"| {r['kernel']} | {r['mask']} | {r.get('fwd_tflops', r.get('error'))} | {r.get('bwd_tflops', '')} |"
            )
    for r in ROWS:
        if r.get("section") in ("metadata", "host_overhead_us", "gpu_tests", "intervals_check"):
            print(json.dumps(r))


if __name__ == "__main__":
    main()
