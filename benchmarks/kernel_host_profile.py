"""Host time against device time per kernel call, for the runners of ``ffa_bench`` (our backends beside the
kernels they wrap), on one GPU.

A short call (a few hundred microseconds of GPU work, as at 8k tokens) is as fast as its host path when the
host cannot run ahead: the timing then measures Python, not the kernel. This script separates the two:

- ``host_us``: host wall time per call while the GPU is held busy by ``torch.cuda._sleep`` queued first (the
  host never waits for the GPU; allocation from the caching allocator does not synchronize);
- ``gpu_ms``: device time per call from CUDA events around ``--calls`` calls queued behind that sleep, so the
  device runs them back to back whatever the host costs;
- ``bench_ms``: ``triton.testing.do_bench`` (what the kernel tables report);
forward and forward + backward (``torch.autograd.grad``). ``--cprofile`` prints each runner's top host
functions (``cProfile``, tottime) over the forward + backward calls.

    python benchmarks/kernel_host_profile.py --seqlen 8192 --masks varlen_causal,full \
        --kernels ffa_cudnn,cudnn_flex,ffa_fa4,fa4 --out /tmp/host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffa_bench import _runners, environment
from ffa_masks import build_mask

SLEEP_CYCLES = 200_000_000  # ~0.1 s of an H200's clock: longer than any burst of host launches below


def _host_and_gpu(fn, calls: int) -> tuple[float, float]:
    """(host us per call, device ms per call) for ``calls`` calls queued behind a sleeping kernel."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / calls


def profile(args) -> list[dict]:
    from triton.testing import do_bench

    kernels = set(args.kernels.split(","))
    hq, hk = (int(x) for x in args.heads.split(":"))
    rows = []
    for name in args.masks.split(","):
        m = build_mask(name, args.seqlen)
        flops = 4 * m.area * hq * args.d
        runners = _runners(m, args.seqlen, hq, hk, args.d, kernels, None)
        for kname, (fn, xs) in runners.items():
            try:
                g = torch.randn_like(fn())

                def fb(fn=fn, xs=xs, g=g):
                    return torch.autograd.grad(fn(), xs, g)

                for _ in range(3):  # compiles, plan and launch caches
                    fb()
                r = dict(kernel=kname, mask=name, S=args.seqlen, hq=hq, hk=hk, d=args.d)
                hf, gf = _host_and_gpu(fn, args.calls)
                hb, gb = _host_and_gpu(fb, args.calls)
                bf = do_bench(fn, warmup=5, rep=40, return_mode="median")
                bb = do_bench(fb, warmup=5, rep=40, return_mode="median")
                r.update(
                    host_fwd_us=round(hf, 1), host_fwdbwd_us=round(hb, 1), gpu_fwd_ms=round(gf, 4),
                    gpu_bwd_ms=round(gb - gf, 4), bench_fwd_ms=round(bf, 4), bench_bwd_ms=round(bb - bf, 4),
                    gpu_fwd_tflops=round(flops / gf / 1e9, 1), gpu_bwd_tflops=round(2.5 * flops / (gb - gf) / 1e9, 1),
                    bench_fwd_tflops=round(flops / bf / 1e9, 1),
                    bench_bwd_tflops=round(2.5 * flops / (bb - bf) / 1e9, 1),
                )  # fmt: skip
                if args.cprofile:
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(args.calls):
                        fb()
                    prof.disable()
                    torch.cuda.synchronize()
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.cprofile)
                    r["cprofile"] = s.getvalue()[-6000:]
            except Exception as e:  # a kernel that cannot run a shape is reported, not hidden
                r = dict(kernel=kname, mask=name, S=args.seqlen, error=repr(e)[:300])
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "cprofile"}), flush=True)
        del runners
        torch.cuda.empty_cache()
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "| S | mask | kernel | host us fwd / fwd+bwd | GPU ms fwd / bwd | do_bench ms fwd / bwd | GPU TFLOP/s "
        "fwd / bwd | do_bench TFLOP/s fwd / bwd |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['S'] // 1024}k | {r['mask']} | {r['kernel']} | error: {r['error'][:80]} | | | | |"
            )
            continue
        lines.append(
            f"| {r['S'] // 1024}k | {r['mask']} | {r['kernel']} | {r['host_fwd_us']:.0f} / {r['host_fwdbwd_us']:.0f} "
            f"| {r['gpu_fwd_ms']:.3f} / {r['gpu_bwd_ms']:.3f} | {r['bench_fwd_ms']:.3f} / {r['bench_bwd_ms']:.3f} "
            f"| {r['gpu_fwd_tflops']:.0f} / {r['gpu_bwd_tflops']:.0f} "
            f"| {r['bench_fwd_tflops']:.0f} / {r['bench_bwd_tflops']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", default="64:8")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--masks", default="varlen_causal,varlen_full,swa_causal_w1024,varlen_block_causal,full")
    ap.add_argument("--kernels", default="ffa_cudnn,cudnn_flex,ffa_fa4,fa4")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument(
        "--cprofile", type=int, default=0, help="top host functions to print per runner (0: none)"
    )
    ap.add_argument("--out", default=None, help="JSON file for the rows (with the environment)")
    args = ap.parse_args()
    rows = profile(args)
    if args.out:
        Path(args.out).write_text(json.dumps({"env": environment(), "rows": rows}, indent=1) + "\n")
    if args.cprofile:
        for r in rows:
            if "cprofile" in r:
                print(f"## {r['kernel']} {r['mask']}\n{r['cprofile'][-2500:]}")
    print(render(rows))


if __name__ == "__main__":
    main()
