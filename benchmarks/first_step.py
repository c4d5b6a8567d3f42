"""How long the first training step takes in a fresh process, with a cold and a warm compile cache.

Each run is a fresh child process; the clock starts at the first ``calc_attn`` call and stops when its
backward has finished (compiles included); steps 2-3 give the steady state. ``kernel_backend="auto"``, a
16k-token packed causal documents mask, heads 64:8, head_dim 128, bf16. Runs, all with
``MAGI_ATTENTION_CACHE_DIR`` (and ``TRITON_CACHE_DIR`` below it) on a fresh directory: ``cp1`` cold, ``cp1``
warm, ``cp1_warmup`` (``magi_attention.warmup(key)`` first), then ``sim8`` / ``sim8_warmup`` (the simulated
cp 8 loop) on a second fresh directory. The cache's size is recorded after each run;
results in ``$OUT/first_step.json`` (or ``--out``).

    python -m benchmarks.first_step --out $OUT     # on one GPU, about 2-4 minutes
    python -m benchmarks.first_step --device cpu --tokens 256 --heads 2,1,16 --runs cp1,sim8_warmup  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import common

TOKENS = 16384
HEADS = (64, 8, 128)
DEVICE = "cuda"
RUNS = ("cp1", "cp1", "cp1_warmup", "sim8", "sim8", "sim8_warmup")
"""The order of the runs; the first run of each kind on its cache directory is cold, the others warm."""


def _mask():
    from magi_attention.vendors import standard_masks

    return next(m for m in standard_masks(TOKENS) if m.name == "docs")


def _dtype():
    import torch

    return torch.bfloat16 if DEVICE == "cuda" else torch.float32  # CPU smoke runs: the torch path in fp32


def _start():
    """CUDA start-up (not timed)."""
    import torch

    if DEVICE == "cuda":
        torch.cuda.init()
        torch.ones(1, device="cuda").sum().item()


def _timed_steps(out: dict, step: Callable[[], object], warm: Callable[[], object] | None) -> dict:
    """``out`` with ``warmup_s`` (``warm``'s seconds, if given), ``first_step_s`` (the first of three calls of
    ``step``) and ``steady_step_s`` (the fastest of the other two); device work waited for."""
    import torch

    device = torch.device(DEVICE)
    if warm is not None:
        out["warmup_s"] = common.host_times_ms(warm, 1, device=device)[0] / 1e3
    steps = [t / 1e3 for t in common.host_times_ms(step, 3, device=device)]
    out.update(first_step_s=steps[0], steady_step_s=min(steps[1:]))
    return out


def child_cp1(warm: bool) -> dict:
    import torch

    from magi_attention import DistAttnConfig, calc_attn, get_kernel_backend, magi_attn_flex_key, warmup

    _start()
    m = _mask()
    hq, hk, d = HEADS
    key = magi_attn_flex_key(m.q_ranges, m.k_ranges, m.types, TOKENS, TOKENS, hq, hk, d, None,
                             DistAttnConfig(kernel_backend="auto"))  # fmt: skip
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(TOKENS, h, d, device=DEVICE, generator=gen, dtype=_dtype()).requires_grad_()
               for h in (hq, hk, hk))  # fmt: skip
    do = torch.randn(TOKENS, hq, d, device=DEVICE, generator=gen, dtype=_dtype())
    resolved, reason = get_kernel_backend(key)
    out = {"backend": getattr(resolved, "value", str(resolved)), "reason": reason}
    return _timed_steps(out, lambda: calc_attn(q, k, v, key)[0].backward(do),
                        (lambda: warmup(key, _dtype(), device=DEVICE)) if warm else None)  # fmt: skip


def child_sim8(warm: bool) -> dict:
    import numpy as np
    import torch

    from magi_attention._runtime.kernels import _resolve, choose_auto, probe_local
    from magi_attention.config import KernelBackend
    from magi_attention.simulate import simulate_dist_attn
    from magi_solver import PlanOptions, plan_attention
    from magi_solver.kernel_choice import busiest_rank_features, kernel_key_ids

    _start()
    m = _mask()
    hq, hk, d = HEADS
    cp = 8
    qr, kr, types = [list(r) for r in m.q_ranges], [list(r) for r in m.k_ranges], list(m.types)
    chunk = TOKENS // cp // 4  # 4 chunks per rank (512 tokens at 16k)
    options = PlanOptions(overlap_degree=2, min_chunk_size=min(256, chunk))
    plan = plan_attention(qr, kr, types, TOKENS, cp, chunk_size=chunk, options=options)
    rows = [np.asarray(plan.dispatch.position_ids(r)) for r in range(cp)]
    keys = kernel_key_ids(rows, plan.kv_layout)
    choice = choose_auto(_resolve(KernelBackend.AUTO, d, [probe_local()]), d,
                         lambda: busiest_rank_features(qr, kr, types, rows, rank_keys=keys))  # fmt: skip
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, do = (torch.randn(TOKENS, h, d, device=DEVICE, generator=gen, dtype=_dtype())
                   for h in (hq, hk, hk, hq))  # fmt: skip
    out = {"backend": choice.backend.value, "reason": choice.reason}
    # warm: one step on other inputs, what magi_attention.warmup does on a real cp 8 key
    return _timed_steps(out, lambda: simulate_dist_attn(q, k, v, do, plan, kernel_backend=choice.backend),
                        (lambda: simulate_dist_attn(q * 0.5, k, v, do, plan, kernel_backend=choice.backend))
                        if warm else None)  # fmt: skip


def run_child(kind: str, cache: str, timeout: int, shape: list[str]) -> dict:
    from magi_ffa.compile_cache import dir_size

    env = dict(os.environ, MAGI_ATTENTION_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    for name in ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "FLEX_ATTENTION_CUTE_DSL_CACHE_DIR",
                 "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED"):  # fmt: skip
        env.pop(name, None)  # ours decide: the point is the default
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.first_step", "--child", kind, *shape], env=env,
                          cwd=common.ROOT, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"kind": kind, "error": proc.stderr[-3000:], "process_s": wall}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(kind=kind, process_s=round(wall, 2), cache_bytes=dir_size(cache))
    return result


def main() -> None:
    global TOKENS, HEADS, DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of first_step.json ($OUT)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per child process")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (fp32)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"mask length (default {TOKENS})")
    parser.add_argument("--heads", default=",".join(map(str, HEADS)), help="heads_q,heads_kv,head_dim")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"runs in order (default {','.join(RUNS)})")
    args = parser.parse_args()
    TOKENS, DEVICE = args.tokens, args.device
    HEADS = tuple(int(x) for x in args.heads.split(","))
    if len(HEADS) != 3 or TOKENS % 128:
        parser.error("--heads needs three integers and --tokens a multiple of 128")
    shape = ["--device", DEVICE, "--tokens", str(TOKENS), "--heads", args.heads]
    runs = args.runs.split(",")
    if not runs or any(r not in RUNS for r in runs):
        parser.error(f"--runs takes names among {sorted(set(RUNS))}")
    if args.child:
        kind = args.child
        fn = {"cp1": lambda: child_cp1(False), "cp1_warmup": lambda: child_cp1(True),
              "sim8": lambda: child_sim8(False), "sim8_warmup": lambda: child_sim8(True)}[kind]  # fmt: skip
        print(json.dumps(fn()))
        return
    runs_out = []
    with tempfile.TemporaryDirectory(prefix="magi_first_step_") as tmp:
        caches = {"cp1": os.path.join(tmp, "a"), "sim8": os.path.join(tmp, "b")}  # one fresh directory each
        seen = set()
        for kind in runs:
            cache = caches[kind.split("_")[0]]
            r = run_child(kind, cache, args.timeout, shape)
            r["cache"] = "warm" if cache in seen else "cold"
            seen.add(cache)
            runs_out.append(r)
            print(json.dumps(r), flush=True)
    import torch

    doc = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)",
        "tokens": TOKENS,
        "heads": list(HEADS),
        "mask": "docs (packed causal documents)",
        "runs": runs_out,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "first_step.json"
    path.write_text(json.dumps(doc, indent=1))
    print(
        f"{'run':<12}{'cache':<6}{'backend':<16}{'warmup s':>9}{'first s':>9}{'steady s':>9}{'cache MiB':>10}"
    )
    for r in runs_out:
        if "error" in r:
            print(f"{r['kind']:<12}{r['cache']:<6}error: {r['error'].splitlines()[-1][:50]}")
            continue
        w = f"{r['warmup_s']:.2f}" if "warmup_s" in r else "-"
        print(f"{r['kind']:<12}{r['cache']:<6}{r['backend'][:15]:<16}{w:>9}{r['first_step_s']:>9.2f}"
              f"{r['steady_step_s']:>9.3f}{r['cache_bytes'] / 2**20:>10.1f}")  # fmt: skip
    print(f"wrote {path}")
    sys.exit(1 if any("error" in r for r in runs_out) else 0)


if __name__ == "__main__":
    main()
