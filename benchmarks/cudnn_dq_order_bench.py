"""cuDNN's deterministic backward with its own dQ write order against the order ``magi_ffa_cudnn`` writes.

    python -m benchmarks.cudnn_dq_order_bench --seqlens 32768 --sim-cp 8 --json OUT.json

One process, one GPU (sm90). Per mask: the cuDNN backend's backward (``magi_ffa_cudnn.ffa_bwd``) in default
mode and in deterministic mode with the plan's dQ write order set to cuDNN's own (group 1), to the shipped
one (``magi_ffa_cudnn._dq_order.RESIDENT_CTAS``) and to a wider one (``--wide``: groups spanning that many
launches, which needs that many of the backward's CTAs resident at once; measured here, where nothing else
runs, to show what the bound costs). The order tensors are rewritten in place between timings, so every
variant runs the same plan and recorded launches. Rounds interleave the variants; cells are the median,
with the spread ((max - min) / median). Masks: the kernel table's (``benchmarks.common.build_mask``) at each
of ``--seqlens``, and with ``--sim-cp`` the busiest rank's merged call of the runtime's plan at that cp
(8k tokens per GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.common import build_mask, environment


def _cases(args):
    """``(name, q, k, v, (q_ranges, k_ranges, types))`` on the GPU, bf16."""
    hq, hk = (int(x) for x in args.heads.split(":"))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def qkv(sq: int, sk: int):
        return [torch.randn(n, h, args.d, device="cuda", dtype=torch.bfloat16, generator=gen)
                for n, h in ((sq, hq), (sk, hk), (sk, hk))]  # fmt: skip

    for S in (int(x) for x in args.seqlens.split(",") if x):
        for mask in args.masks.split(","):
            m = build_mask(mask, S)
            yield f"{mask} {S // 1024}k", *qkv(S, S), (m.q_ranges, m.k_ranges, m.attn_type_map)
    if args.sim_cp:
        from benchmarks.kernel_backends_bench import _planned
        from magi_attention.simulate import rank_calls

        for mask in args.sim_masks.split(","):
            total, plan, _ = _planned(mask, args.sim_cp, 8192)
            rp = max(
                plan.ranks,
                key=lambda r: (r.host_slices.area() + sum(s.remote_slices.area() for s in r.stages), -r.rank),
            )
            k = torch.empty(total, 1, 1)
            kv = plan.kv_layout
            rc = rank_calls(rp, k, k, None if kv is None else kv.host_token_ranges(rp.rank), merged=True)
            for i, (ranges, kk, _) in enumerate(c for c in rc.calls if c[0][0].shape[0]):
                sq = total // args.sim_cp  # the rank's own queries
                yield (
                    f"{mask} cp {args.sim_cp} busiest rank, call {i}",
                    *qkv(sq, kk.shape[0]),
                    tuple(t.cuda() for t in ranges),
                )


def _measure(name, q, k, v, ranges, variants: dict, args) -> dict:
    """One case's backward ms per variant (median over the interleaved rounds) and spread."""
    import magi_ffa_cudnn
    from magi_ffa_cudnn._dq_order import reorder_deterministic_dq
    from triton.testing import do_bench

    out, lse = magi_ffa_cudnn.ffa_fwd(q, k, v, *ranges)[:2]
    do = torch.randn_like(q)
    plan = magi_ffa_cudnn.get_mask_plan(q, k, *ranges)

    def bwd(det: bool):
        return magi_ffa_cudnn.ffa_bwd(do, q, k, v, out, lse, *ranges, deterministic=det)

    bwd(False), bwd(True)  # compile and record both launches (the deterministic one rewrites the order)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant, resident in variants.items():
            if resident is not None:
                reorder_deterministic_dq(plan.mask_plan, resident)
            times[variant].append(do_bench(lambda r=resident: bwd(r is not None), warmup=5, rep=args.rep))
    reorder_deterministic_dq(plan.mask_plan)  # the plan as the backend leaves it
    med = {v: statistics.median(t) for v, t in times.items()}
    return {"case": name, "bwd_ms": med, "spread": {v: (max(t) - min(t)) / med[v] for v, t in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="32768")
    ap.add_argument("--masks", default="full,varlen_causal,swa_causal_w1024,varlen_block_causal,random")
    ap.add_argument("--sim-cp", type=int, default=0)
    ap.add_argument("--sim-masks", default="varlen_causal,full")
    ap.add_argument("--heads", default="64:8")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--wide", type=int, default=128, help="the wider variant's launches per group (0: none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rep", type=int, default=25, help="do_bench window per timing (ms)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from magi_ffa_cudnn._dq_order import RESIDENT_CTAS

    variants = {"default": None, "cudnn order": 1, f"groups of {RESIDENT_CTAS}": RESIDENT_CTAS}
    if args.wide:
        variants[f"groups of {args.wide}"] = args.wide
    rows = []
    for name, q, k, v, ranges in _cases(args):
        row = _measure(name, q, k, v, ranges, variants, args)
        rows.append(row)
        med = row["bwd_ms"]
        print(f"{name}: " + "; ".join(f"{v} {med[v]:.2f} ({med[v] / med['default']:.2f}x)" for v in variants))
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "rows": rows}, f, indent=1)
    print(f"\n| mask | {' | '.join(variants)} |\n|---|{'---|' * len(variants)}")
    for r in rows:
        b = r["bwd_ms"]
        print(
            f"| {r['case']} | "
            + " | ".join(f"{b[v]:.2f} ({b[v] / b['default']:.2f}x)" for v in variants)
            + " |"
        )


if __name__ == "__main__":
    main()
