"""Benchmark the FFA Triton kernel against FlexAttention, SDPA (cuDNN / flash) and optional FA4 entries.

One process on one GPU. TFLOP/s from the masked area: FLOPs(fwd) = 4 * area * heads_q * head_dim,
FLOPs(bwd) = 2.5 * FLOPs(fwd); bwd time = median(fwd + bwd) - median(fwd) (do_bench medians after warm-up).
Inputs and Flex block masks are built outside the timed region.

    python benchmarks/ffa_bench.py --seqlens 32768 --heads 64:8 --masks full,causal --out-dir /tmp/ffa
    python benchmarks/ffa_bench.py --render /tmp/ffa/ffa_bench.json      # -> docs/benchmarks/ffa.md

Kernels: ffa (magi_ffa.flex_flash_attn_func), flex, sdpa_cudnn, sdpa_flash (full/causal only), and, when
importable, ffa_fa4 (magi_ffa_fa4.flex_flash_attn_func), fa4 (flash_attn.cute native calls), ffa_cudnn
(magi_ffa_cudnn.flex_flash_attn_func), cudnn_flex (cuDNN's own ``flex_attn_func`` on the same interval mask,
its plan built outside the timing) and cudnn_varlen (``flex_attn_func`` on the varlen THD path, one sample per
document with local intervals; varlen masks only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffa_masks import MASK_NAMES, BenchMask, build_mask

from magi_attention._runtime.vendor_kernels import SliceMask, cudnn_flex_call, fa4_call

ROOT = Path(__file__).resolve().parents[1]
KERNELS = (
    "ffa",
    "flex",
    "sdpa_cudnn",
    "sdpa_flash",
    "ffa_fa4",
    "fa4",
    "ffa_cudnn",
    "cudnn_flex",
    "cudnn_varlen",
)


def _flex_setup():
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # one compiled kernel per mask: raise the limits or Flex silently falls back to an eager O(N^2) path
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def _runners(m: BenchMask, S: int, hq: int, hk: int, d: int, kernels: set[str], flex_tools):
    """name -> (fn, inputs needing grad); every input tensor is created here, outside the timing."""
    import magi_ffa

    dev, dt = "cuda", torch.bfloat16
    out = {}
    q = torch.randn(S, hq, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(S, hk, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(S, hk, d, device=dev, dtype=dt, requires_grad=True)
    if "ffa" in kernels:
        out["ffa"] = (lambda: magi_ffa.flex_flash_attn_func(q, k, v, m.q_ranges, m.k_ranges, m.attn_type_map)[0],
                      (q, k, v))  # fmt: skip
    if "ffa_fa4" in kernels:
        try:
            import magi_ffa_fa4

            out["ffa_fa4"] = (
                lambda: magi_ffa_fa4.flex_flash_attn_func(q, k, v, m.q_ranges, m.k_ranges, m.attn_type_map)[
                    0
                ],
                (q, k, v),
            )
        except Exception as e:  # optional entry
            print(f"# ffa_fa4 unavailable: {e!r}"[:200])
    if "ffa_cudnn" in kernels:
        try:
            import magi_ffa_cudnn

            magi_ffa_cudnn.get_mask_plan(
                q, k, m.q_ranges, m.k_ranges, m.attn_type_map
            )  # plan outside the timing
            out["ffa_cudnn"] = (
                lambda: magi_ffa_cudnn.flex_flash_attn_func(q, k, v, m.q_ranges, m.k_ranges, m.attn_type_map)[
                    0
                ],
                (q, k, v),
            )
        except Exception as e:  # optional entry
            print(f"# ffa_cudnn unavailable: {e!r}"[:200])
    for name in ("cudnn_flex", "cudnn_varlen"):
        if name in kernels:
            try:
                runner = _cudnn_runner(m, q, k, v, varlen=name == "cudnn_varlen")
                if runner is not None:
                    out[name] = runner
            except Exception as e:  # optional entry
                print(f"# {name} unavailable for {m.name}: {e!r}"[:200])
    qb, kb, vb = (t.detach().transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v))  # [1, h, S, d]
    gqa = hq != hk
    if "flex" in kernels:
        flex, create_block_mask = flex_tools
        bm = create_block_mask(m.mask_mod, 1, 1, S, S, device=dev) if m.mask_mod is not None else None
        out["flex"] = (lambda: flex(qb, kb, vb, block_mask=bm, enable_gqa=gqa), (qb, kb, vb))
    if m.cudnn_causal is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        for name, be in (
            ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
            ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ):
            if name in kernels:

                def f(be=be):
                    with sdpa_kernel([be]):
                        return sdpa(qb, kb, vb, is_causal=m.cudnn_causal, enable_gqa=gqa)

                out[name] = (f, (qb, kb, vb))
    if "fa4" in kernels and m.name != "random":
        try:
            out["fa4"] = _fa4_runner(m, q, k, v)
        except Exception as e:  # optional entry
            print(f"# fa4 unavailable for {m.name}: {e!r}"[:200])
    for name, backend in CALC_ATTN_RUNNERS.items():
        if name in kernels:
            try:
                out[name] = _calc_attn_runner(m, q, k, v, backend)
            except Exception as e:  # a backend this machine cannot run is reported, not hidden
                print(f"# {name} unavailable: {e!r}"[:200])
    return out


CALC_ATTN_RUNNERS = {"auto": "auto", "calc_fa4": "fa4", "calc_cudnn": "cudnn", "calc_triton": "triton"}
"""Runner name -> ``kernel_backend`` of the runtime's ``calc_attn`` at cp = 1 (the call a user makes)."""


def _calc_attn_runner(m: BenchMask, q, k, v, backend: str):
    """The runtime's ``calc_attn`` at cp = 1 with ``kernel_backend=backend`` on the same inputs (its key
    built outside the timing; the backend it resolved and why printed)."""
    from magi_attention import DistAttnConfig, calc_attn, get_kernel_backend, magi_attn_flex_key

    S, hq, d = q.shape
    key = magi_attn_flex_key(m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(), S, S, hq,
                             k.shape[1], d, None, DistAttnConfig(kernel_backend=backend))  # fmt: skip
    resolved, reason = get_kernel_backend(key)
    print(f"# calc_attn({backend}) on {m.name} {S}: {resolved.value} ({reason})", flush=True)
    return (lambda: calc_attn(q, k, v, key)[0], (q, k, v))


def _slice_mask(m: BenchMask, total: int) -> SliceMask:
    """The bench mask as the vendor calls' mask (``magi_attention._runtime.vendor_kernels``, one definition of each
    vendor call); ``swa_causal_wN`` is also FA4's / Flex's causal window of N keys (itself included)."""
    window = int(m.name.removeprefix("swa_causal_w")) - 1 if m.name.startswith("swa_causal_w") else None
    return SliceMask.of(m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(), total, name=m.name,
                        window=window)  # fmt: skip


def _fa4_runner(m: BenchMask, q, k, v):
    """flash_attn.cute native calls for the masks FA4 expresses (full, causal, varlen, sliding window)."""
    return fa4_call(_slice_mask(m, q.shape[0]), q, k, v)


def _cudnn_runner(m: BenchMask, q, k, v, *, varlen: bool):
    """cuDNN's own flex_attn_func: the packed problem as one BSHD sample with the mask's global key intervals,
    or (``varlen``, varlen_* masks) the THD path with one sample per document and local intervals."""
    from cudnn.flex_attention import create_mask_plan, flex_attn_func

    S = q.shape[0]
    if not varlen:
        return cudnn_flex_call(_slice_mask(m, S), q, k, v)
    if m.name not in ("varlen_full", "varlen_causal"):
        return None
    cu = torch.tensor([0, *m.q_ranges[:, 1].tolist()], dtype=torch.int32, device=q.device)
    mx = int((m.q_ranges[:, 1] - m.q_ranges[:, 0]).max())
    pos = torch.arange(S, device=q.device) - torch.repeat_interleave(cu[:-1], cu.diff())
    end = pos + 1 if m.name == "varlen_causal" else torch.repeat_interleave(cu.diff(), cu.diff())
    func = end.to(torch.int32).reshape(1, 1, S).contiguous()
    qv, kv, vv = (t.detach().requires_grad_() for t in (q, k, v))
    plan = create_mask_plan(func, qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx,
                            build_backward=True)  # fmt: skip
    return (lambda: flex_attn_func(qv, kv, vv, mask_plan=plan), (qv, kv, vv))


def bench(args) -> list[dict]:
    from triton.testing import do_bench

    kernels = set(args.kernels.split(","))
    flex_tools = _flex_setup() if "flex" in kernels else None
    rows = []
    for S in (int(s) for s in args.seqlens.split(",")):
        for heads in args.heads.split(","):
            hq, hk = (int(x) for x in heads.split(":"))
            for name in args.masks.split(","):
                m = build_mask(name, S)
                flops = 4 * m.area * hq * args.d
                for kname, (fn, xs) in _runners(m, S, hq, hk, args.d, kernels, flex_tools).items():
                    r = dict(kernel=kname, mask=name, S=S, hq=hq, hk=hk, d=args.d, area=m.area)
                    try:
                        o = fn()
                        g = torch.randn_like(o)
                        tf = do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
                        tfb = do_bench(lambda fn=fn, xs=xs, g=g: torch.autograd.grad(fn(), xs, g),
                                       warmup=args.warmup, rep=args.rep, return_mode="median")  # fmt: skip
                        r.update(fwd_ms=round(tf, 4), bwd_ms=round(tfb - tf, 4),
                                 fwd_tflops=round(flops / tf / 1e9, 1),
                                 bwd_tflops=round(2.5 * flops / (tfb - tf) / 1e9, 1))  # fmt: skip
                    except Exception as e:  # a baseline that cannot run a shape is reported, not hidden
                        r["error"] = repr(e)[:300]
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                torch.cuda.empty_cache()
    return rows


def environment() -> dict:
    import triton

    return dict(
        date=datetime.date.today().isoformat(),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        torch=torch.__version__,
        triton=triton.__version__,
        git=os.popen(f"git -C {ROOT} rev-parse --short HEAD 2>/dev/null").read().strip() or "unknown",
    )


# Targets of issue 3 (H200, 32k, 64:8): FlexAttention x1.3 on these masks, cuDNN x0.9 on full/causal.
FLEX_TARGET_MASKS = {"varlen_full", "varlen_causal", "swa_causal_w1024", "swa_causal_w4096",
                     "varlen_block_causal", "random"}  # fmt: skip


def render(data: dict) -> str:
    env, rows = data["env"], data["rows"]
    kern = [k for k in KERNELS if any(r["kernel"] == k and "error" not in r for r in rows)]
    lines = [
        "# Kernels (magi-ffa)",
        "",
        f"Measured {env['date']} on {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit "
        f"{env['git']}, by `benchmarks/ffa_bench.py` (one process; bf16; TFLOP/s = 4 * area * heads_q * d / "
        "time, bwd 2.5x; medians of `triton.testing.do_bench` after warm-up). Cells are fwd / bwd TFLOP/s.",
        "",
        "| S | heads | mask | " + " | ".join(kern) + " | ffa / flex | ffa / cuDNN |",
        "|---|---|---|" + "---|" * len(kern) + "---|---|",
    ]
    keys = sorted(
        {(r["S"], r["hq"], r["hk"], r["mask"]) for r in rows},
        key=lambda x: (x[0], -x[1], MASK_NAMES.index(x[3])),
    )
    for S, hq, hk, mask in keys:
        by = {r["kernel"]: r for r in rows if (r["S"], r["hq"], r["hk"], r["mask"]) == (S, hq, hk, mask)}

        def cell(k, by=by):
            r = by.get(k)
            if r is None:
                return "-"
            return "err" if "error" in r else f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f}"

        def ratio(a, b, by=by):
            ra, rb = by.get(a), by.get(b)
            if not ra or not rb or "error" in ra or "error" in rb:
                return "-"
            return f"{ra['fwd_tflops'] / rb['fwd_tflops']:.2f} / {ra['bwd_tflops'] / rb['bwd_tflops']:.2f}"

        lines.append(f"| {S // 1024}k | {hq}:{hk} | {mask} | " + " | ".join(cell(k) for k in kern)
                     + f" | {ratio('ffa', 'flex')} | {ratio('ffa', 'sdpa_cudnn')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--masks", default=",".join(MASK_NAMES))
    ap.add_argument("--seqlens", default="8192,32768")
    ap.add_argument("--heads", default="64:8,16:16")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=60, help="do_bench measurement window (ms)")
    ap.add_argument("--out-dir", default=".", help="where ffa_bench.json and ffa_bench.md go")
    ap.add_argument("--render", help="render a saved JSON into docs/benchmarks/ffa.md and exit")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        (ROOT / "docs/benchmarks/ffa.md").write_text(render(data) + data.get("notes", ""))
        return
    data = dict(env=environment(), rows=bench(args))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ffa_bench.json").write_text(json.dumps(data, indent=1))
    (out / "ffa_bench.md").write_text(render(data))
    print(render(data))


if __name__ == "__main__":
    main()
