"""Where the FA4 backend's backward and its overlap stages spend their time, beside FlashAttention-4's own.

1. ``--what kernels``: per-kernel CUDA time (torch.profiler) of one backward of magi-ffa-fa4 and of FA4's
   native call on the same mask and inputs (varlen causal through ``flash_attn_varlen_func``, sliding window
   through ``window_size``, full), and the tile classes our backward visits (Full / Partial per 128 x 128
   sparse block, k->q lists).
2. ``--what stages``: one simulated rank at degree 1 (a host call and a remote call and their merges, the
   runtime's order) against the same rank's whole problem in one call: per-kernel CUDA time and the host
   gaps between launches.
3. ``--ncu``: run each backward once more after warm-up between ``cudaProfilerStart/Stop`` for
   ``ncu --profile-from-start off --clock-control none`` (the device script adds the ncu command line).

    python benchmarks/fa4_bwd_profile.py --what kernels --tokens 32768 --masks varlen_causal,swa_causal_w2048,full
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffa_bench import _fa4_runner
from ffa_masks import build_mask

import magi_ffa_fa4
from magi_ffa_fa4._launch_meta import get_launch_meta


def _profile(fn, label: str, iters: int = 3) -> dict:
    """CUDA time per kernel name (us per iteration) and the iteration's wall time (us)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    launches = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:90]] += ev.device_time / iters
            launches += 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    wall = start.elapsed_time(end) * 1e3 / iters
    kernel_sum = sum(per.values())
    out = dict(label=label, wall_us=round(wall, 1), kernel_us=round(kernel_sum, 1),
               gaps_us=round(wall - kernel_sum, 1), launches=launches // iters,
               kernels={k: round(v, 1) for k, v in sorted(per.items(), key=lambda x: -x[1])})  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def _tile_counts(meta) -> dict:
    if meta.varlen is not None:  # FA4's own varlen kernels: no sparse blocks
        return {"varlen_groups": [dict(entries=len(g.q_ranges), window=[g.window_left, g.window_right])
                                  for g in meta.varlen.groups]}  # fmt: skip
    res = {}
    for name, sm in (("fwd", meta.meta_fwd), ("bwd", meta.meta_bwd)):
        lists = sm.q2k if name == "fwd" else sm.k2q
        full, part = int(lists.full_cnt.sum()), int(lists.mask_cnt.sum())
        res[name] = dict(block=[sm.block_m, sm.block_n], full=full, partial=part,
                         grid=sm.num_m * sm.num_n, partial_share=round(part / max(1, full + part), 3))  # fmt: skip
    return res


def kernels(args) -> list[dict]:
    rows = [_kernels_one(name, args) for name in args.masks.split(",")]
    torch.cuda.empty_cache()
    return rows


def _kernels_one(name: str, args) -> dict:
    hq, hk = (int(x) for x in args.heads.split(":"))
    S, d = args.tokens, args.d
    m = build_mask(name, S)
    q, k, v = (torch.randn(S, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hk, hk))
    do = torch.randn_like(q)
    o, lse = magi_ffa_fa4.ffa_fwd(q, k, v, m.q_ranges, m.k_ranges, m.attn_type_map)
    meta = get_launch_meta(m.q_ranges, m.k_ranges, m.attn_type_map, S, S, q.device)

    def ours():
        magi_ffa_fa4.ffa_bwd(do, q, k, v, o, lse, m.q_ranges, m.k_ranges, m.attn_type_map)

    row = dict(
        mask=name, S=S, hq=hq, hk=hk, d=d, tiles=_tile_counts(meta), ours=_profile(ours, "magi_ffa_fa4")
    )
    try:
        fn, xs = _fa4_runner(m, *(t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())))
        y = fn()
        g = torch.randn_like(y)

        def native():
            torch.autograd.grad(y, xs, g, retain_graph=True)

        row["native"] = _profile(native, "fa4_native")
    except Exception as e:
        row["native_error"] = repr(e)[:200]
    if args.ncu:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        ours()
        if "native" in row:
            native()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return row


def stages(args) -> list[dict]:
    """One simulated rank of cp ``--cp`` at degree 1 against its whole problem in one call."""
    return [_stages_one(name, args) for name in args.masks.split(",")]


def _stages_one(name: str, args) -> dict:
    from magi_attention_bench import HKV, HQ, D, make_plan

    from magi_attention.simulate import kernel_ranges

    total, plan = make_plan(name, args.cp, args.tokens, 1)
    rp = max(plan.ranks, key=lambda r: r.host_area + sum(s.area for s in r.stages))
    shard = total // args.cp
    q = torch.randn(shard, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(shard, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    calls = [(kernel_ranges(rp.host_slices), k, v)]
    for s in rp.stages:
        n = s.num_remote_tokens
        rk, rv = (torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        calls.append((kernel_ranges(s.remote_slices), rk, rv))
    calls = [c for c in calls if c[0][0].shape[0]]

    def fwd():
        (qr, kr, tr), kk, vv = calls[0]
        o, l = magi_ffa_fa4.ffa_fwd(q, kk, vv, qr, kr, tr)
        for (qr, kr, tr), kk, vv in calls[1:]:
            magi_ffa_fa4.ffa_fwd(q, kk, vv, qr, kr, tr, out=o, lse=l)
        return o, l

    o, l = fwd()

    def bwd():
        dq = torch.zeros(q.shape, device="cuda")
        for (qr, kr, tr), kk, vv in calls:
            dk, dv = (torch.zeros(kk.shape, device="cuda") for _ in range(2))
            magi_ffa_fa4.ffa_bwd(do, q, kk, vv, o, l, qr, kr, tr, dq=dq, dk=dk, dv=dv)

    # the same rank's problem in one call: its host and remote keys concatenated, slices shifted
    kk = torch.cat([c[1] for c in calls])
    vv = torch.cat([c[2] for c in calls])
    qrs, krs, trs, off = [], [], [], 0
    for (qr, kr, tr), kc, _ in calls:
        qrs.append(qr.cpu())
        krs.append(kr.cpu() + off)
        trs.append(tr.cpu())
        off += kc.shape[0]
    one = (torch.cat(qrs), torch.cat(krs), torch.cat(trs))
    o1, l1 = magi_ffa_fa4.ffa_fwd(q, kk, vv, *one)
    row = dict(mask=name, cp=args.cp, tokens_per_gpu=args.tokens, calls=len(calls), rank=rp.rank)
    row["stages_fwd"] = _profile(fwd, "stages_fwd")
    row["stages_bwd"] = _profile(bwd, "stages_bwd")
    row["one_fwd"] = _profile(lambda: magi_ffa_fa4.ffa_fwd(q, kk, vv, *one), "one_call_fwd")
    row["one_bwd"] = _profile(lambda: magi_ffa_fa4.ffa_bwd(do, q, kk, vv, o1, l1, *one), "one_call_bwd")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", choices=("kernels", "stages"), default="kernels")
    ap.add_argument("--masks", default="varlen_causal,swa_causal_w2048,full")
    ap.add_argument(
        "--tokens", type=int, default=32768, help="total tokens (kernels) or tokens per GPU (stages)"
    )
    ap.add_argument("--heads", default="64:8")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = kernels(args) if args.what == "kernels" else stages(args)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
