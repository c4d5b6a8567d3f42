"""Distributed context-parallel benchmark (issue 6): magi-attention against Ulysses, zigzag ring attention and
all-gather K/V, all four computing with the same local kernel (magi_ffa), so the table isolates the
distribution scheme.

One process per GPU (NCCL), or per CPU rank over gloo with ``--device cpu`` (toy sizes, for smoke runs)::

    torchrun --standalone --nproc-per-node 8 benchmarks/cp_bench.py --out /tmp/cp_bench
    torchrun --standalone --nproc-per-node 2 benchmarks/cp_bench.py --device cpu --tokens-per-gpu 64 \\
        --heads 4:2 --head-dim 16 --chunk-size 16 --min-chunk-size 8 --warmup 1 --iters 2 --out /tmp/cp_cpu

For every (tokens per GPU, mask, system): the global q/k/v/dout are drawn from one seed on every rank,
sharded the system's way, then one forward + backward whose output (and dq) is compared with magi's (rel
diff = ||x - x_magi|| / ||x_magi|| over the whole sequence), ``--warmup`` more, then ``--iters`` timed
iterations (CUDA events; the host clock on CPU), each started after a barrier. Per iteration the slowest
rank's time counts; the table shows the median. TFLOP/s/GPU = FLOPs / (time x cp), FLOPs(fwd) = 4 x mask
area x heads_q x head_dim, FLOPs(bwd) = 2.5 x FLOPs(fwd). Writes ``<out>.json`` and ``<out>.md`` and prints
the markdown table last (rank 0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cp_baselines sits next to this script

from cp_baselines import CPBaseline, baseline_attn, plan_baseline, shard_tokens

from magi_attention import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention.api import calc_attn, clear_cache, dispatch, magi_attn_flex_key, undispatch
from magi_solver import SliceList

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast (NVLS) stays off in every multi-GPU run of this project; set before NCCL initialises."""


class System(StrEnum):
    MAGI = "magi"
    ULYSSES = "ulysses"
    RING_ZIGZAG = "ring_zigzag"
    ALLGATHER_KV = "allgather_kv"


MASKS = ("full", "causal", "varlen_full", "varlen_causal")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """One run's settings (the same on every rank)."""

    device: str
    """"cuda" (NCCL, one GPU per rank) or "cpu" (gloo)."""
    tokens_per_gpu: tuple[int, ...]
    masks: tuple[str, ...]
    systems: tuple[System, ...]
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    warmup: int
    iters: int
    chunk_size: int
    """magi: DispatchConfig.chunk_size (tokens per dispatch chunk)."""
    degree: int
    """magi: OverlapConfig.degree (remote stages; 0 = no overlap)."""
    min_chunk_size: int
    """magi: OverlapConfig.min_chunk_size."""
    seed: int


def varlen_docs(total: int, seed: int) -> list[list[int]]:
    """Long-tailed document lengths (log-normal around total/16), each at most total/4, packed in order."""
    rng = random.Random(seed)
    cap, floor = max(1, total // 4), max(1, total // 512)
    bounds, start = [], 0
    while start < total:
        n = max(floor, min(int(rng.lognormvariate(math.log(max(total / 16, 1.0)), 1.0)), cap))
        bounds.append([start, min(total, start + n)])
        start += n
    return bounds


def make_mask(name: str, total: int, seed: int) -> tuple[list, list, list]:
    """``(q_ranges, k_ranges, types)`` of a benchmark mask over ``total`` tokens."""
    if name in ("full", "causal"):
        return [[0, total]], [[0, total]], [int(name == "causal")]
    if name in ("varlen_full", "varlen_causal"):
        docs = varlen_docs(total, seed)
        return docs, docs, [int(name == "varlen_causal")] * len(docs)
    raise ValueError(f"mask must be one of {MASKS}, got {name!r}")


def mask_area(q_ranges, k_ranges, types) -> int:
    return SliceList.from_typed([(*q, *k, t) for q, k, t in zip(q_ranges, k_ranges, types)]).area()


# -- timing -------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(device: torch.device) -> None:
    """A tiny all-reduce, then wait for it: every rank starts the next iteration together."""
    dist.all_reduce(torch.zeros(1, device=device))
    _sync(device)


def _time_iters(
    step: Callable[[], torch.Tensor],
    inputs: Sequence[torch.Tensor],
    do: torch.Tensor,
    cfg: BenchConfig,
    device,
) -> tuple[list[float], list[float]]:
    """Per timed iteration: (forward ms, backward ms), each the max over ranks."""
    fwd, bwd = [], []
    for it in range(cfg.warmup + cfg.iters):
        _barrier(device)
        if device.type == "cuda":
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
            out = step()
            ev[1].record()
            torch.autograd.grad(out, inputs, do)
            ev[2].record()
            torch.cuda.synchronize(device)
            tf, tb = ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])
        else:
            t0 = time.perf_counter()
            out = step()
            t1 = time.perf_counter()
            torch.autograd.grad(out, inputs, do)
            tf, tb = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        if it >= cfg.warmup:
            fwd.append(tf)
            bwd.append(tb)
    t = torch.tensor([fwd, bwd], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].tolist(), t[1].tolist()


def _rel_diff(local: torch.Tensor, ref_local: torch.Tensor, device) -> float:
    """||local - ref|| / ||ref|| summed over every rank's rows (fp64)."""
    a, r = local.detach().double(), ref_local.detach().double()
    sums = torch.stack([(a - r).square().sum(), r.square().sum()]).to(device)
    dist.all_reduce(sums)
    return math.sqrt(sums[0].item() / max(sums[1].item(), 1e-300))


# -- one configuration --------------------------------------------------------------------------------------
def run_case(system: System, mask: str, tpg: int, data: dict, ref: dict, cfg: BenchConfig, device) -> dict:
    """Benchmark one system on one mask; ``ref`` holds magi's global out/dq for the cross-check (filled when
    ``system`` is magi)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    total = tpg * cp
    qr, kr, tm = make_mask(mask, total, cfg.seed)
    area = mask_area(qr, kr, tm)
    row = {"system": system.value, "mask": mask, "tokens_per_gpu": tpg, "cp": cp, "area": area}
    hq, hkv, d = cfg.heads_q, cfg.heads_kv, cfg.head_dim
    q, k, v, do = data["q"], data["k"], data["v"], data["do"]
    if system == System.MAGI:
        config = DistAttnConfig(
            dispatch_config=DispatchConfig(chunk_size=cfg.chunk_size),
            overlap_config=OverlapConfig(degree=cfg.degree, min_chunk_size=cfg.min_chunk_size),
        )
        key = magi_attn_flex_key(qr, kr, tm, total, total, hq, hkv, d, dist.group.WORLD, config)
        inputs = [dispatch(t, key).detach().requires_grad_() for t in (q, k, v)]
        do_local = dispatch(do, key)

        def step() -> torch.Tensor:
            return calc_attn(*inputs, key)[0]
    else:
        try:
            plan = plan_baseline(
                CPBaseline(system.value), qr, kr, tm, total, cp, rank, num_heads_q=hq, num_heads_kv=hkv
            )
        except ValueError as exc:  # e.g. Ulysses with heads not divisible by cp: same on every rank
            return {**row, "skipped": str(exc)}
        inputs = [shard_tokens(t, plan).requires_grad_() for t in (q, k, v)]
        do_local = shard_tokens(do, plan)
        idx = plan.token_index(device)

        def step() -> torch.Tensor:
            return baseline_attn(*inputs, plan)[0]

    # first iteration: correctness cross-check against magi's output and dq
    out = step()
    (dq,) = torch.autograd.grad(out, inputs[:1], do_local, retain_graph=False)
    if system == System.MAGI:
        ref.update(out=undispatch(out.detach().contiguous(), key), dq=undispatch(dq.contiguous(), key))
        row.update(rel_out=0.0, rel_dq=0.0)
    elif ref:
        row.update(
            rel_out=_rel_diff(out, ref["out"][idx], device), rel_dq=_rel_diff(dq, ref["dq"][idx], device)
        )
    del out, dq
    fwd, bwd = _time_iters(step, inputs, do_local, cfg, device)
    f_ms, b_ms = statistics.median(fwd), statistics.median(bwd)
    flops = 4 * area * hq * d
    row.update(
        fwd_ms=f_ms,
        bwd_ms=b_ms,
        fwd_ms_all=fwd,
        bwd_ms_all=bwd,
        fwd_tflops=flops / (f_ms * 1e-3 * cp) / 1e12,
        bwd_tflops=2.5 * flops / (b_ms * 1e-3 * cp) / 1e12,
    )
    if system == System.MAGI:
        clear_cache()
    return row


def _global_data(total: int, cfg: BenchConfig, device) -> dict:
    """Global q/k/v/dout, identical on every rank (one seed), in the benchmark dtype."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    dt = DTYPES[cfg.dtype]

    def randn(h: int) -> torch.Tensor:
        return torch.randn(total, h, cfg.head_dim, generator=gen, device=device, dtype=torch.float32).to(dt)

    return {
        "q": randn(cfg.heads_q),
        "k": randn(cfg.heads_kv),
        "v": randn(cfg.heads_kv),
        "do": randn(cfg.heads_q),
    }


# -- report ---------------------------------------------------------------------------------------------------
def _meta(cfg: BenchConfig, device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "n/a"
    try:
        sha = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        git_sha = sha.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        git_sha = "unknown"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "date": datetime.date.today().isoformat(),
        "world_size": dist.get_world_size(),
        "device": name,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "git": git_sha,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
    }


def markdown(meta: dict, rows: list[dict]) -> str:
    c = meta["config"]
    lines = [
        f"{meta['date']} | {meta['world_size']} x {meta['device']} ({meta['backend']}) | torch {meta['torch']} | "
        f"triton {meta['triton']} | git {meta['git']} | heads {c['heads_q']}:{c['heads_kv']}, d {c['head_dim']}, "
        f"{c['dtype']} | magi chunk {c['chunk_size']}, degree {c['degree']}, min chunk {c['min_chunk_size']} | "
        f"median of {c['iters']} after {c['warmup'] + 1} warm-up",
        "",
        "| tokens/GPU | mask | system | fwd ms | bwd ms | fwd TFLOP/s/GPU | bwd TFLOP/s/GPU | rel diff out / dq vs magi |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['tokens_per_gpu']} | {r['mask']} | {r['system']} |"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped'].split(':')[0]} | | | | |")
            continue
        rel = f"{r['rel_out']:.1e} / {r['rel_dq']:.1e}" if "rel_out" in r else "n/a (magi not run)"
        lines.append(
            f"{head} {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['fwd_tflops']:.4g} | {r['bwd_tflops']:.4g} | {rel} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, str | None]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens-per-gpu", default="8192,16384", help="comma-separated")
    ap.add_argument("--masks", default=",".join(MASKS))
    ap.add_argument("--systems", default=",".join(s.value for s in System))
    ap.add_argument("--heads", default="64:8", help="heads_q:heads_kv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up iterations after the checked first one")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--chunk-size", type=int, default=2048, help="magi DispatchConfig.chunk_size")
    ap.add_argument("--degree", type=int, default=2, help="magi OverlapConfig.degree")
    ap.add_argument("--min-chunk-size", type=int, default=512, help="magi OverlapConfig.min_chunk_size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="path prefix: writes <out>.json and <out>.md")
    a = ap.parse_args(argv)
    try:
        hq, hkv = (int(x) for x in a.heads.split(":"))
        systems = tuple(System(s) for s in a.systems.split(","))
    except ValueError as exc:
        ap.error(f"--heads must be Q:KV ints and --systems from {[s.value for s in System]}: {exc}")
    masks = tuple(a.masks.split(","))
    if bad := [m for m in masks if m not in MASKS]:
        ap.error(f"--masks: unknown {bad}, choose from {MASKS}")
    cfg = BenchConfig(
        device=a.device,
        tokens_per_gpu=tuple(int(x) for x in a.tokens_per_gpu.split(",")),
        masks=masks,
        systems=systems,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=a.head_dim,
        dtype=a.dtype,
        warmup=a.warmup,
        iters=a.iters,
        chunk_size=a.chunk_size,
        degree=a.degree,
        min_chunk_size=a.min_chunk_size,
        seed=a.seed,
    )
    return cfg, a.out


def run(cfg: BenchConfig, out: str | None) -> list[dict]:
    """The whole benchmark on an initialised process group; returns the rows (every rank)."""
    if cfg.device == "cuda":
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        )
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    rows = []
    for tpg in cfg.tokens_per_gpu:
        data = _global_data(tpg * dist.get_world_size(), cfg, device)
        for mask in cfg.masks:
            ref: dict = {}
            systems = sorted(
                cfg.systems, key=lambda s: s != System.MAGI
            )  # magi first: the cross-check reference
            for system in systems:
                rows.append(run_case(system, mask, tpg, data, ref, cfg, device))
                if dist.get_rank() == 0:
                    r = rows[-1]
                    status = r.get("skipped") or f"fwd {r['fwd_ms']:.3f} ms, bwd {r['bwd_ms']:.3f} ms"
                    print(f"[cp_bench] {tpg}/GPU {mask} {system.value}: {status}", flush=True)
        del data
    if dist.get_rank() == 0:
        meta = _meta(cfg, device)
        table = markdown(meta, rows)
        if out:
            prefix = out.removesuffix(".json").removesuffix(".md")
            Path(prefix).parent.mkdir(parents=True, exist_ok=True)
            Path(prefix + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            Path(prefix + ".md").write_text(table)
        print(table, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    for name, value in NO_MULTICAST.items():
        os.environ.setdefault(name, value)
    own_group = not dist.is_initialized()
    if own_group:  # torchrun sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if cfg.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    try:
        run(cfg, out)
    finally:
        if own_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
