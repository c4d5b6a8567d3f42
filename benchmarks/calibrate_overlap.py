"""Calibrate the overlap cost model (`magi_solver.CostProfile`) on this GPU, per kernel backend.
What it measures and how to run it: docs/benchmarks/cases.md (calibrate)."""

import functools
import json

import numpy as np
import torch
import torch.distributed as dist
import triton.testing

from benchmarks.cli import add_common, heads, ints, names, run_module, write_results
from benchmarks.common import events_loop_ms, join_torchrun
from magi_attention.config import KernelBackend
from magi_attention.simulate import kernel_launchers
from magi_solver import CostProfile, get_profile, gpu_kind


def bench_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x, a clamped at >= 0."""
    b, a = np.polyfit(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), 1)
    return max(float(a), 0.0), float(b)


def kernel_fit(backend: KernelBackend, tq: int, key_lens: list[int], hq: int, hkv: int, d: int, dev) -> dict:
    kern = kernel_launchers(backend)
    q = torch.randn(tq, hq, d, device=dev, dtype=torch.bfloat16)
    do = torch.randn_like(q)
    areas, fwd_s, bwd_s = [], [], []
    for tk in key_lens[::-1]:  # the shortest last: its tensors serve the stage overheads below
        k = torch.randn(tk, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qr, kr, tm = torch.tensor([[0, tq]], dtype=torch.int32), torch.tensor([[0, tk]], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)  # fmt: skip
        out, lse = kern.fwd(q, k, v, qr, kr, tm)
        areas.insert(0, tq * tk)
        fwd_s.insert(0, bench_ms(functools.partial(kern.fwd, q, k, v, qr, kr, tm)) * 1e-3)
        bwd_s.insert(0, bench_ms(functools.partial(kern.bwd, do, q, k, v, out, lse, qr, kr, tm)) * 1e-3)
    f0, f1 = fit_line(areas, fwd_s)
    b0, b1 = fit_line(areas, bwd_s)
    per_pair = 4.0 * hq * d
    # stage overheads (the first key length): merge into an existing accumulator / accumulate dq into fp32
    acc, acc_lse = out.float(), lse.clone()
    plain = bench_ms(lambda: kern.fwd(q, k, v, qr, kr, tm))
    merged = bench_ms(lambda: kern.fwd(q, k, v, qr, kr, tm, out=acc, lse=acc_lse))
    dq, dk, dv = (torch.zeros(t.shape, device=dev, dtype=torch.float32) for t in (q, k, v))
    bplain = bench_ms(lambda: kern.bwd(do, q, k, v, out, lse, qr, kr, tm))
    baccum = bench_ms(lambda: kern.bwd(do, q, k, v, out, lse, qr, kr, tm, dq=dq, dk=dk, dv=dv))
    return {"fwd_tflops": per_pair / f1 / 1e12, "bwd_tflops": 2.5 * per_pair / b1 / 1e12, "fwd_fixed_s": f0,
            "bwd_fixed_s": b0, "merge_s_per_elem": max(merged - plain, 0.0) * 1e-3 / q.numel(),
            "dq_accum_s_per_elem": max(baccum - bplain, 0.0) * 1e-3 / q.numel(),
            "points": {"area": areas, "fwd_s": fwd_s, "bwd_s": bwd_s}}  # fmt: skip


def copy_gbps(dev) -> float:
    x = torch.empty(256 * 2**20, dtype=torch.float32, device=dev)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9


def comm_fit(dev, hkv: int, d: int) -> tuple[float, float] | None:
    """(GB/s per rank sent, latency s) of all_to_all_single on the group, or None on one rank; a fixed
    count of iterations on every rank (do_bench's count per rank leaves them in different collectives)."""
    world = dist.get_world_size()
    if world < 2:
        return None
    sizes, times = [], []
    for t in (512, 2048, 8192, 32768):
        x = torch.randn(t * world, 2 * hkv, d, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        sizes.append(x.numel() * 2 * (world - 1) / world)
        times.append(events_loop_ms(lambda x=x, y=y: dist.all_to_all_single(y, x), 10, 3) * 1e-3)
    t_all = torch.tensor(times, device=dev, dtype=torch.float64)
    dist.all_reduce(t_all, op=dist.ReduceOp.MAX)
    lat, s_per_byte = fit_line(sizes, t_all.tolist())
    return 1.0 / s_per_byte / 1e9, lat


def add_arguments(ap) -> None:
    add_common(ap, heads="64:8", head_dim=128, out_dir=None)
    ap.add_argument("--backends", default="fa4,triton")
    ap.add_argument("--q-tokens", type=int, default=8192)
    ap.add_argument("--key-lens", default="1024,4096,16384")


def main(a) -> int:
    dev = join_torchrun(cuda=True)
    hq, hkv = heads(a.heads)
    kind = gpu_kind(torch.cuda.get_device_name(dev))
    mem = copy_gbps(dev)
    comm = comm_fit(dev, hkv, a.head_dim)
    profiles = {}
    for name in names(a.backends):
        backend = KernelBackend(name)
        fit = kernel_fit(backend, a.q_tokens, ints(a.key_lens), hq, hkv, a.head_dim, dev)
        shipped = get_profile(kind, backend.value)
        profile = CostProfile(
            name=f"{kind}/{backend.value}", fwd_tflops=fit["fwd_tflops"], bwd_tflops=fit["bwd_tflops"],
            kernel_fixed_s=max(1e-6, 0.5 * (fit["fwd_fixed_s"] + fit["bwd_fixed_s"])), mem_gbps=mem,
            fwd_merge_bytes_per_elem=max(1.0, fit["merge_s_per_elem"] * mem * 1e9),
            bwd_accum_bytes_per_elem=max(1.0, fit["dq_accum_s_per_elem"] * mem * 1e9),
            comm_gbps=comm[0] if comm else shipped.comm_gbps,
            comm_latency_s=max(1e-6, comm[1]) if comm else shipped.comm_latency_s, estimate=False,
        )  # fmt: skip
        profiles[profile.name] = {"profile": profile.to_dict(), "fit": fit}
    if dist.get_rank() == 0:
        for pname, p in profiles.items():
            write_results(a.out_dir, pname.replace("/", "_"), p["profile"])
        write_results(a.out_dir, "calibration_fit", profiles)
        for pname, p in profiles.items():
            f = p["fit"]
            print(f"{pname}: fwd {f['fwd_tflops']:.0f} TFLOP/s + {f['fwd_fixed_s'] * 1e6:.0f} us, bwd "
                  f"{f['bwd_tflops']:.0f} + {f['bwd_fixed_s'] * 1e6:.0f} us, merge {f['merge_s_per_elem'] * 1e12:.2f} "
                  f"ps/elem, dq accum {f['dq_accum_s_per_elem'] * 1e12:.2f} ps/elem, copy {mem:.0f} GB/s, comm "
                  f"{(f'{comm[0]:.0f} GB/s + {comm[1] * 1e6:.0f} us') if comm else 'n/a (1 GPU)'}")  # fmt: skip
            print(json.dumps(p["profile"]))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
