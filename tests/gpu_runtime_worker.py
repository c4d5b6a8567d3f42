"""GPU correctness of the distributed runtime in bf16 against dense fp64, per kernel backend.

The worker of ``tests/test_gpu_checks.py`` (which runs it and grades its JSON verdict): ``python
tests/gpu_runtime_worker.py`` on one GPU checks cp = 1 and the simulated ranks of larger cp sizes; one process
per GPU (``torchrun --standalone --nproc-per-node N tests/gpu_runtime_worker.py``, N >= 2) runs the runtime
over NCCL. For every
(backend, mask, overlap degree): out, lse, dq, dk, dv of ``calc_attn`` (undispatched, whole sequence) must
be within twice the error of ONE single-GPU call of the same backend's FFA on the whole mask, plus 1e-4
(relative Frobenius error against a dense fp64 reference). Prints one line per case and a summary last;
exits 1 on any failure. ``--out FILE`` writes ``{"failed": n, "rows": [...]}`` as JSON (rank 0). ``--uneven-shard`` plans with
``DispatchConfig(uneven_shard=True)`` (no padding; pick ``--tokens`` not a multiple of 256 x N to see ranks
of different token counts). ``--grpcoll native`` (or ``MAGI_ATTENTION_NATIVE_GRPCOLL=1``) runs the runtime's
group collectives natively; the summary names the implementation the plans used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
import torch.distributed as dist

from magi_attention import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention._runtime.cache import RUNTIME_CACHE
from magi_attention._runtime.kernels import attn_kernel
from magi_attention.api import calc_attn, clear_cache, dispatch, magi_attn_flex_key, undispatch
from magi_attention.config import KernelBackend
from magi_attention.simulate import simulate_dist_attn
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_solver import (
    PlanOptions,
    make_block_causal_mask,
    make_sliding_window_mask,
    make_varlen_causal_mask,
    make_varlen_full_mask,
    plan_attention,
)

for _name, _value in {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(_name, _value)

QUANTITIES = ("out", "lse", "dq", "dk", "dv")
IMPLS_USED: set[str] = set()  # group-collective implementations the runtime's plans used (for the summary)


def _docs(total: int, rng: random.Random) -> list[int]:
    cu, s = [0], 0
    while s < total:
        s = min(total, s + rng.randrange(total // 10, total // 3))
        cu.append(s)
    return cu


def masks(total: int, seed: int) -> dict[str, tuple[list, list, list]]:
    rng = random.Random(seed)
    cu = _docs(total, rng)
    out = {}
    for name, spec in (
        ("varlen_causal", make_varlen_causal_mask(cu)),
        ("varlen_full", make_varlen_full_mask(cu)),
        ("block_causal", make_block_causal_mask(cu, 384)),
        ("sliding_window", make_sliding_window_mask([0, total], (700, 0))),
    ):
        out[name] = (
            [[r.start, r.end] for r in spec.q_ranges],
            [[r.start, r.end] for r in spec.k_ranges],
            [t.code for t in spec.types],
        )
    # random overlapping slices of all four types (the union is the mask), some rows with no key
    qr, kr, tm = [], [], []
    for _ in range(12):
        a, b = sorted(rng.randrange(total + 1) for _ in range(2))
        c, e = sorted(rng.randrange(total + 1) for _ in range(2))
        if a < b and c < e:
            qr.append([a, b])
            kr.append([c, e])
            tm.append(rng.randrange(4))
    out["random_overlap"] = (qr, kr, tm)
    return out


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    finite = torch.isfinite(ref)
    x, ref = x.double()[finite], ref[finite]
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def dense_reference(q, k, v, do, mask):
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = ref_attn(qr, kr, vr, mask)
    (out * do.double()).sum().backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}


def single_call(backend: KernelBackend, q, k, v, do, qr, kr, tm):
    """One single-GPU FFA call of `backend` on the whole mask (the error yardstick)."""
    kern = attn_kernel(backend)
    ranges = [torch.tensor(x, dtype=torch.int32).reshape(-1, 2) for x in (qr, kr)]
    types = torch.tensor(tm, dtype=torch.int32)
    out, lse = kern.fwd(q, k, v, ranges[0], ranges[1], types)
    dq, dk, dv = kern.bwd(do, q, k, v, out, lse, ranges[0], ranges[1], types)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def check(got: dict, base: dict, ref: dict) -> tuple[bool, dict]:
    errs, ok = {}, True
    for name in QUANTITIES:
        e, b = rel(got[name], ref[name]), rel(base[name], ref[name])
        errs[name] = (e, b)
        if not (e <= 2 * b + 1e-4) or e != e:
            ok = False
        if name == "lse" and not torch.equal(torch.isneginf(got[name]), torch.isneginf(ref[name])):
            ok = False
    return ok, errs


def run_dist(backend, degree, mask, total, q, k, v, do, hq, hkv, d, chunk, uneven=False):
    qr, kr, tm = mask
    overlap = OverlapConfig(degree=None if degree == "dynamic" else int(degree), min_chunk_size=256)
    config = DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=chunk, uneven_shard=uneven),
        overlap_config=overlap,
        kernel_backend=backend,
    )
    key = magi_attn_flex_key(qr, kr, tm, total, total, hq, hkv, d, dist.group.WORLD, config)
    ins = [dispatch(t, key).detach().requires_grad_() for t in (q, k, v)]
    out, meta = calc_attn(*ins, key)
    out.backward(dispatch(do, key))
    runtime = RUNTIME_CACHE.get(key)
    plan = runtime.plan
    chosen = getattr(plan, "overlap_degree", 0) if plan is not None else "-"
    IMPLS_USED.update(p.impl.value for p in runtime.device_meta(q.device).cast_plans)
    got = {
        "out": undispatch(out.detach(), key),
        "lse": undispatch(meta.lse, key),
        "dq": undispatch(ins[0].grad, key),
        "dk": undispatch(ins[1].grad, key),
        "dv": undispatch(ins[2].grad, key),
    }
    clear_cache()
    return got, chosen


def run_simulated(backend, cp, mask, total, q, k, v, do, chunk, uneven=False):
    qr, kr, tm = mask
    options = PlanOptions(overlap_degree=2, min_chunk_size=128, uneven_shard=uneven)
    plan = plan_attention(qr, kr, tm, total, cp, chunk_size=chunk, options=options)
    out, lse, dq, dk, dv = simulate_dist_attn(q, k, v, do, plan, kernel_backend=backend)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def single_process_world() -> None:
    """Without torchrun: a world of one process (rank 0) on a free local port."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="total tokens of the sequence")
    ap.add_argument("--heads", default="8:2")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--backends", default="fa4,triton")
    ap.add_argument("--degrees", default="0,1,2,dynamic")
    ap.add_argument("--simulate-cp", default="4,8", help="world size 1 only: simulated cp sizes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--uneven-shard", action="store_true", help="DispatchConfig(uneven_shard=True)")
    ap.add_argument(
        "--grpcoll",
        choices=("env", "a2av", "native"),
        default="env",
        help="group collectives of the runtime: sets MAGI_ATTENTION_NATIVE_GRPCOLL (env: leave it as it is)",
    )
    a = ap.parse_args()
    if a.grpcoll != "env":
        os.environ["MAGI_ATTENTION_NATIVE_GRPCOLL"] = "1" if a.grpcoll == "native" else "0"
    single_process_world()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    hq, hkv = (int(x) for x in a.heads.split(":"))
    d, total = a.head_dim, a.tokens
    rows, failures = [], 0
    for mask_name, mask in masks(total, seed=1).items():
        gen = torch.Generator(device=dev).manual_seed(len(rows) + 17)
        q, k, v, do = (
            torch.randn(total, h, d, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
            for h in (hq, hkv, hkv, hq)
        )
        dense = make_attn_mask(*mask, total, total).to(dev)
        ref = dense_reference(q, k, v, do, dense)
        for backend in a.backends.split(","):
            b = KernelBackend(backend)
            base = single_call(b, q, k, v, do, *mask)
            cases = (
                [(f"cp{world}/deg{deg}", deg) for deg in a.degrees.split(",")] if world > 1 else [("cp1", 0)]
            )
            if world == 1:
                cases += [(f"sim-cp{c}", int(c)) for c in a.simulate_cp.split(",") if c]
            for label, deg in cases:
                if label.startswith("sim"):
                    got, chosen = run_simulated(b, deg, mask, total, q, k, v, do, 128, a.uneven_shard), 2
                else:
                    got, chosen = run_dist(b, deg, mask, total, q, k, v, do, hq, hkv, d, 256, a.uneven_shard)
                ok, errs = check(got, base, ref)
                failures += not ok
                row = {
                    "mask": mask_name,
                    "backend": backend,
                    "case": label,
                    "chosen_degree": chosen,
                    "ok": ok,
                }
                row.update({n: {"err": e, "single_call_err": s} for n, (e, s) in errs.items()})
                rows.append(row)
                if rank == 0:
                    detail = " ".join(f"{n} {e:.1e}/{s:.1e}" for n, (e, s) in errs.items())
                    print(
                        f"{'ok  ' if ok else 'FAIL'} {backend:6s} {mask_name:15s} {label:12s} deg={chosen} {detail}",
                        flush=True,
                    )
    if rank == 0:
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"failed": failures, "rows": rows}, f, indent=1)
        print(
            f"gpu_runtime_check: world {world}{' uneven_shard' if a.uneven_shard else ''}, {len(rows)} cases, "
            f"{failures} failed (err/single-call err per quantity; rule err <= 2x + 1e-4); group collectives "
            f"{','.join(sorted(IMPLS_USED)) or 'none (cp 1)'}"
        )
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
