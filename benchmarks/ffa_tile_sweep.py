"""Tile sweep of the Triton FFA kernels on one GPU, beside FlexAttention, in one process.

For one head_dim: every (forward tiles, backward tiles) pair of ``--pairs`` on the sweep masks (FlexAttention
measured once per mask), then the best pair (sum of fwd + bwd TFLOP/s over the sweep masks) on ``--final-masks``
beside FlexAttention and cuDNN SDPA. Same measurement as ``ffa_bench.py`` (do_bench medians; bwd = (fwd + bwd)
- fwd; TFLOP/s = 4 * area * heads_q * d, bwd 2.5x). JSON rows on stdout (``{...}`` lines) and in ``--out``.

    python benchmarks/ffa_tile_sweep.py --d 128 --pairs "128,128,8,3/64,128,128,64,8,3;128,64,8,3/64,64,64,64,4,3"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffa_bench import _flex_setup, _runners, environment
from ffa_masks import build_mask


def measure(fn, xs, flops: float, warmup: int, rep: int) -> dict:
    from triton.testing import do_bench

    o = fn()
    g = torch.randn_like(o)
    tf = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    tfb = do_bench(lambda: torch.autograd.grad(fn(), xs, g), warmup=warmup, rep=rep, return_mode="median")
    return dict(fwd_ms=round(tf, 4), bwd_ms=round(tfb - tf, 4), fwd_tflops=round(flops / tf / 1e9, 1),
                bwd_tflops=round(2.5 * flops / (tfb - tf) / 1e9, 1))  # fmt: skip


def kernel_resources() -> dict:
    """Registers / spills / shared memory of every compiled variant of the FFA kernels so far (ptxas' view)."""
    from magi_ffa._triton_bwd import ffa_bwd_kernel
    from magi_ffa._triton_fwd import ffa_fwd_kernel

    out = {}
    for name, kern in (("fwd", ffa_fwd_kernel), ("bwd", ffa_bwd_kernel)):
        try:
            for cache in kern.device_caches.values():
                for key, ck in cache[0].items():
                    out[
                        f"{name}:{hash(key) & 0xFFFF:04x}:w{ck.metadata.num_warps}s{ck.metadata.num_stages}"
                    ] = dict(regs=ck.n_regs, spills=ck.n_spills, smem=ck.metadata.shared)
        except Exception as e:  # internal Triton structures: best effort
            out[name] = repr(e)[:100]
    return out


def run(kernels: set[str], mask_name: str, a, flex_tools, tiles: tuple[str, str] | None = None) -> list[dict]:
    if tiles:
        os.environ["MAGI_FFA_TILES_FWD"], os.environ["MAGI_FFA_TILES_BWD"] = tiles
    m = build_mask(mask_name, a.seqlen)
    flops = 4 * m.area * a.hq * a.d
    rows = []
    for name, (fn, xs) in _runners(m, a.seqlen, a.hq, a.hk, a.d, kernels, flex_tools).items():
        r = dict(kernel=name, mask=mask_name, S=a.seqlen, hq=a.hq, hk=a.hk, d=a.d)
        if name == "ffa" and tiles:
            r.update(fwd_tiles=tiles[0], bwd_tiles=tiles[1])
        try:
            r.update(measure(fn, xs, flops, a.warmup, a.rep))
            if name == "ffa":
                r["resources"] = kernel_resources()
        except Exception as e:  # a config that cannot compile (shared memory) is reported, not fatal
            r["error"] = repr(e)[:200]
        rows.append(r)
        print(json.dumps(r), flush=True)
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", default="64:8")
    ap.add_argument(
        "--pairs", required=True, help="'FWD/BWD;FWD/BWD;...' tile strings (see magi_ffa env docs)"
    )
    ap.add_argument("--masks", default="full,causal,varlen_causal")
    ap.add_argument(
        "--final-masks", default="full,causal,varlen_causal,swa_causal_w1024,varlen_block_causal,random"
    )
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.hq, a.hk = (int(x) for x in a.heads.split(":"))
    flex_tools = _flex_setup()
    pairs = [tuple(p.split("/")) for p in a.pairs.split(";")]
    rows: list[dict] = []
    for mask in a.masks.split(","):
        rows += run({"flex"}, mask, a, flex_tools)
        for p in pairs:
            rows += run({"ffa"}, mask, a, flex_tools, p)

    def score(p):
        rs = [r for r in rows if r.get("fwd_tiles") == p[0] and r.get("bwd_tiles") == p[1]]
        if any("error" in r for r in rs):
            return -1.0
        # forward and backward chosen separately would need crossing the lists; the pair is the unit here
        return sum(r["fwd_tflops"] + r["bwd_tflops"] for r in rs)

    best = max(pairs, key=score)
    print(json.dumps({"best": best, "d": a.d}), flush=True)
    final = []
    for mask in a.final_masks.split(","):
        final += run({"flex", "sdpa_cudnn"}, mask, a, flex_tools)
        final += run({"ffa"}, mask, a, flex_tools, best)
    if a.out:
        Path(a.out).write_text(
            json.dumps(dict(env=environment(), sweep=rows, best=best, final=final), indent=1)
        )
    print(f"\n# d={a.d} best tiles fwd {best[0]} bwd {best[1]}; TFLOP/s fwd / bwd, ffa / flex")
    for mask in a.final_masks.split(","):
        by = {r["kernel"]: r for r in final if r["mask"] == mask and "error" not in r}
        f, x = by.get("ffa"), by.get("flex")
        if f and x:
            print(f"{mask:22s} ffa {f['fwd_tflops']:6.1f} / {f['bwd_tflops']:6.1f}  flex {x['fwd_tflops']:6.1f} / "
                  f"{x['bwd_tflops']:6.1f}  ratio {f['fwd_tflops'] / x['fwd_tflops']:.2f} / "
                  f"{f['bwd_tflops'] / x['bwd_tflops']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
