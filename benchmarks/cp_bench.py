"""Distributed context-parallel benchmark: magi-attention against the baselines on the same inputs.
What it measures and how to run it: docs/benchmarks/cases.md (cp)."""

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import common
from benchmarks.baselines import user
from benchmarks.baselines.same_kernel import baseline_attn, plan_baseline, shard_tokens
from benchmarks.cli import add_common, run_module, table, usage_error, write_results
from benchmarks.common import mask_area
from magi_attention import DispatchConfig, DistAttnConfig, GrpCollConfig, OverlapConfig, api
from magi_attention.env import native_grpcoll


class System(StrEnum):
    """magi, the same-kernel baselines (baselines/same_kernel.py) and the user baselines (baselines/user.py)."""

    MAGI = "magi"
    ULYSSES, RING_ZIGZAG, ALLGATHER_KV = "ulysses", "ring_zigzag", "allgather_kv"
    ULYSSES_FA4, ULYSSES_CUDNN, TORCH_CP = "ulysses_fa4", "ulysses_cudnn", "torch_cp"
    ULYSSES_FFA_FA4, ULYSSES_FFA_CUDNN = "ulysses_ffa_fa4", "ulysses_ffa_cudnn"


SAME_KERNEL = (System.ULYSSES, System.RING_ZIGZAG, System.ALLGATHER_KV)
MASKS = ("full", "causal", "varlen_full", "varlen_causal", "varlen_block_causal")
KERNEL_BACKENDS = ("auto", "fa4", "cudnn", "triton", "torch")
DYNAMIC = "dynamic"


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """One run's settings (the same on every rank): the options of the same names (`add_arguments`);
    ``degrees`` and ``kernel_backends``: one magi row per entry."""

    device: str
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
    degrees: tuple[int | str, ...]
    min_chunk_size: int
    kernel_backends: tuple[str, ...]
    grad_reduce: str = "fp32"
    grpcoll: str = "env"
    block_size: int
    seed: int
    profile: str | None = None


def varlen_docs(total: int, seed: int) -> list[list[int]]:
    """The benchmark's documents: ``benchmarks.common.varlen_docs`` with a floor of ``total / 512`` tokens."""
    return common.varlen_docs(total, seed, floor=max(1, total // 512))


def make_mask(name: str, total: int, seed: int, block_size: int = 2048) -> tuple[list, list, list]:
    """``(q_ranges, k_ranges, types)`` of a benchmark mask over ``total`` tokens. ``varlen_block_causal``: a
    FULL slice per ``block_size`` block of each varlen document: q the block, k its document up to its end."""
    if name in ("full", "causal"):
        return [[0, total]], [[0, total]], [int(name == "causal")]
    if name in ("varlen_full", "varlen_causal"):
        docs = varlen_docs(total, seed)
        return docs, docs, [int(name == "varlen_causal")] * len(docs)
    if name == "varlen_block_causal":
        if block_size <= 0:
            raise ValueError(f"`block_size` must be a positive int, got {block_size}")
        q_ranges, k_ranges = [], []
        for start, end in varlen_docs(total, seed):
            for b in range(start, end, block_size):
                q_ranges.append([b, min(b + block_size, end)])
                k_ranges.append([start, min(b + block_size, end)])
        return q_ranges, k_ranges, [0] * len(q_ranges)
    raise ValueError(f"mask must be one of {MASKS}, got {name!r}")


# -- timing -------------------------------------------------------------------------------------------------
def _barrier(device: torch.device) -> None:
    """A tiny all-reduce, then wait for it: every rank starts the next iteration together."""
    dist.all_reduce(torch.zeros(1, device=device))
    common.sync(device)


def _time_iters(step: Callable[[], torch.Tensor], inputs: Sequence[torch.Tensor], do: torch.Tensor,
                cfg: BenchConfig, device) -> tuple[list[float], list[float], dict]:  # fmt: skip
    """Per timed iteration: (forward ms, backward ms), each the max over ranks; and the peak memory (GiB, max
    over ranks) of the warm-up + timed iterations, absolute and above what was allocated when they started
    (None on CPU)."""
    mem = {"peak_mem_gib": None, "peak_mem_over_start_gib": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
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
        del out
        if it >= cfg.warmup:
            fwd.append(tf)
            bwd.append(tb)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        m = torch.tensor([peak, peak - start], dtype=torch.float64, device=device) / 2**30
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        mem = {"peak_mem_gib": m[0].item(), "peak_mem_over_start_gib": m[1].item()}
    t = torch.tensor([fwd, bwd], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].tolist(), t[1].tolist(), mem


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    """(p25, p75), inclusive method (the range of the data itself for fewer than 2 points)."""
    if len(xs) < 2:
        return min(xs), max(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _rel_diff(local: torch.Tensor, ref_local: torch.Tensor, device) -> float:
    """||local - ref|| / ||ref|| summed over every rank's rows (fp64)."""
    a, r = local.detach().double(), ref_local.detach().double()
    sums = torch.stack([(a - r).square().sum(), r.square().sum()]).to(device)
    dist.all_reduce(sums)
    return math.sqrt(sums[0].item() / max(sums[1].item(), 1e-300))


def _agree(reason: str | None, device) -> str | None:
    """Every rank learns whether any rank has a reason to skip, and the first such reason (rank order)."""
    flag = torch.tensor([reason is not None], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return None
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next(r for r in reasons if r is not None)


# -- the systems ------------------------------------------------------------------------------------------
MAGI_KERNELS = {"auto": "FFA, kernel backend auto", "fa4": "FFA on FA4 (magi_ffa_fa4)",
                "cudnn": "FFA on cuDNN flex_attention (magi_ffa_cudnn)", "triton": "FFA Triton (magi_ffa)",
                "torch": "FFA torch path (magi_ffa)"}  # fmt: skip


def _dist_attn_config(cfg: BenchConfig, degree: int | str, kernel_backend: str) -> DistAttnConfig:
    overlap = OverlapConfig(degree=None if degree == DYNAMIC else int(degree), min_chunk_size=cfg.min_chunk_size)  # fmt: skip
    return DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=cfg.chunk_size), overlap_config=overlap,
                          kernel_backend=kernel_backend, high_precision_grad_reduce=cfg.grad_reduce == "fp32",
                          grpcoll_config=GrpCollConfig(native={"env": None, "native": True, "a2av": False}[cfg.grpcoll]))  # fmt: skip


def _magi_case(q, k, v, do, qr, kr, tm, cfg: BenchConfig, degree: int | str, kernel_backend: str) -> tuple:
    """``(case, key)``: magi set up on this rank; its rows are compared through the key's undispatch."""
    total, hq, hkv, d = q.shape[0], cfg.heads_q, cfg.heads_kv, cfg.head_dim
    config = _dist_attn_config(cfg, degree, kernel_backend)
    key = api.magi_attn_flex_key(qr, kr, tm, total, total, hq, hkv, d, dist.group.WORLD, config)
    inputs = [api.dispatch(t, key).detach().requires_grad_() for t in (q, k, v)]

    def step() -> torch.Tensor:
        return api.calc_attn(*inputs, key)[0]

    backend = str(api.get_kernel_backend(key, q.dtype)[0])
    kernel = MAGI_KERNELS.get(backend, f"FFA ({backend})")
    return user.UserCase(step=step, inputs=inputs, dout=api.dispatch(do, key), token_index=None, kernel=kernel), key  # fmt: skip


def _same_kernel_case(system: System, q, k, v, do, qr, kr, tm, cfg: BenchConfig, device) -> user.UserCase:
    cp, rank, total = dist.get_world_size(), dist.get_rank(), q.shape[0]
    # ValueError (e.g. Ulysses with heads not divisible by cp): the same on every rank
    plan = plan_baseline(system.value, qr, kr, tm, total, cp, rank, num_heads_q=cfg.heads_q, num_heads_kv=cfg.heads_kv)  # fmt: skip
    inputs = [shard_tokens(t, plan).requires_grad_() for t in (q, k, v)]

    def step() -> torch.Tensor:
        return baseline_attn(*inputs, plan)[0]

    forced = os.environ.get("MAGI_FFA_BACKEND", "").strip().lower()
    fast = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    kernel = f"magi_ffa {forced or ('Triton' if fast else 'torch path')}"
    index = plan.token_index(device)
    return user.UserCase(
        step=step, inputs=inputs, dout=shard_tokens(do, plan), token_index=index, kernel=kernel
    )


def _profile_once(case: user.UserCase, path: Path, device) -> None:
    """One forward + backward, under torch.profiler on rank 0 (the others run it plain, for the collectives);
    rank 0 writes the top 25 ops by self device time (self CPU time on a CPU run)."""

    def step() -> None:
        torch.autograd.grad(case.step(), case.inputs, case.dout)
        common.sync(device)

    _barrier(device)
    if dist.get_rank() != 0:
        return step()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table, _ = common.profile_table(step, device.type == "cuda", sort, width=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{path.stem}: one forward + backward, rank 0, top 25 ops by {sort}\n{table}\n")


# -- one configuration --------------------------------------------------------------------------------------
def run_case(system: System, mask: str, tpg: int, data: dict, ref: dict, cfg: BenchConfig, device,
             degree: int | str | None = None, profile_path: Path | None = None, kernel_backend: str = "auto") -> dict:  # fmt: skip
    """Benchmark one system on one mask (magi: with overlap ``degree`` and ``kernel_backend``); ``ref`` holds
    the first magi row's global out/dq for the cross-check (filled by that row). A system that cannot run the
    case returns a row with ``skipped`` (every rank agrees on it)."""
    cp = dist.get_world_size()
    total = tpg * cp
    qr, kr, tm = make_mask(mask, total, cfg.seed, cfg.block_size)
    area = mask_area(qr, kr, tm)
    row = {"system": system.value, "mask": mask, "tokens_per_gpu": tpg, "cp": cp, "area": area}
    q, k, v, do = data["q"], data["k"], data["v"], data["do"]
    case, reason, key = None, None, None
    if system == System.MAGI:
        row["degree"] = DYNAMIC if degree is None else degree
        row["kernel_backend"] = kernel_backend
        case, key = _magi_case(q, k, v, do, qr, kr, tm, cfg, row["degree"], kernel_backend)
    elif system in SAME_KERNEL:
        try:
            case = _same_kernel_case(system, q, k, v, do, qr, kr, tm, cfg, device)
        except ValueError as exc:
            reason = str(exc)
    else:
        try:
            case = user.build_case(system.value, q, k, v, do, user.Mask.of(qr, kr, tm, q.shape[0]))
        except user.Unavailable as exc:
            reason = str(exc)
    if reason := _agree(reason, device):
        if case is not None:
            case.close()
        return {**row, "skipped": reason}
    row["kernel"] = case.kernel
    try:
        # first iteration: correctness cross-check against magi's output and dq. A user system's kernel may
        # fail here (unsupported shape, JIT error): its row is then skipped rather than ending the run.
        try:
            out = case.step()
            (dq,) = torch.autograd.grad(out, case.inputs[:1], case.dout)
            failure = None
        except Exception as exc:
            if system == System.MAGI or system in SAME_KERNEL:
                raise
            failure = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if failure := _agree(failure, device):
            return {**row, "skipped": failure}
        if system == System.MAGI:
            out_g, dq_g = (api.undispatch(x.detach().contiguous(), key) for x in (out, dq))
            if not ref:
                ref.update(out=out_g, dq=dq_g)
                row.update(rel_out=0.0, rel_dq=0.0)
            else:  # the global tensors are on every rank: each compares its share of the rows
                share = slice(dist.get_rank(), None, cp)
                row.update(
                    rel_out=_rel_diff(out_g[share], ref["out"][share], device),
                    rel_dq=_rel_diff(dq_g[share], ref["dq"][share], device),
                )
            del out_g, dq_g
            row["degree_used"] = api.get_dispatch_choice(key).overlap_degree
        elif ref:
            idx = case.token_index
            if (
                dq.dim() == 4
            ):  # SDPA-layout leaves [1, heads, tokens, d] (torch_cp): compare as [tokens, heads, d]
                dq = dq[0].transpose(0, 1)
            row.update(rel_out=_rel_diff(out, ref["out"][idx], device), rel_dq=_rel_diff(dq, ref["dq"][idx], device))  # fmt: skip
        del out, dq
        fwd, bwd, mem = _time_iters(case.step, case.inputs, case.dout, cfg, device)
        if profile_path is not None:
            _profile_once(case, profile_path, device)
    finally:
        case.close()
        if system == System.MAGI:
            api.clear_cache()
    f_ms, b_ms = statistics.median(fwd), statistics.median(bwd)
    flops = 4 * area * cfg.heads_q * cfg.head_dim
    row.update(fwd_ms=f_ms, bwd_ms=b_ms, fwd_iqr_ms=_quartiles(fwd), bwd_iqr_ms=_quartiles(bwd), fwd_ms_all=fwd,
               bwd_ms_all=bwd, fwd_tflops=flops / (f_ms * 1e-3 * cp) / 1e12,
               bwd_tflops=2.5 * flops / (b_ms * 1e-3 * cp) / 1e12, **mem)  # fmt: skip
    return row


def add_speedups(rows: list[dict]) -> None:
    """On each magi row: the fastest non-magi row of the same (tokens, mask), forward and backward separately,
    and the speedup = its median time / magi's (> 1: magi is faster)."""
    for r in rows:
        if r["system"] != System.MAGI or "skipped" in r:
            continue
        others = [o for o in rows if o["system"] != System.MAGI and "skipped" not in o
                  and (o["tokens_per_gpu"], o["mask"]) == (r["tokens_per_gpu"], r["mask"])]  # fmt: skip
        for p in ("fwd", "bwd"):
            if others:
                best = min(others, key=lambda o: o[f"{p}_ms"])
                r[f"{p}_best_baseline"] = best["system"]
                r[f"{p}_speedup"] = best[f"{p}_ms"] / r[f"{p}_ms"]


def _global_data(total: int, cfg: BenchConfig, device) -> dict:
    """Global q/k/v/dout, identical on every rank (one seed), in the benchmark dtype."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    dt = common.DTYPES[cfg.dtype]

    def randn(h: int) -> torch.Tensor:
        return torch.randn(total, h, cfg.head_dim, generator=gen, device=device, dtype=torch.float32).to(dt)

    heads = {"q": cfg.heads_q, "k": cfg.heads_kv, "v": cfg.heads_kv, "do": cfg.heads_q}
    return {name: randn(h) for name, h in heads.items()}


# -- report ---------------------------------------------------------------------------------------------------
def _meta(cfg: BenchConfig, device) -> dict:
    env = common.environment()
    return {"date": env["date"], "world_size": dist.get_world_size(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": dist.get_backend(), "torch": env["torch"], "triton": env["triton"], "cuda": torch.version.cuda,
            "git": env["git"], "grpcoll": cfg.grpcoll if cfg.grpcoll != "env" else "native" if native_grpcoll() else "a2av",
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}}  # fmt: skip


def _ms(r: dict, p: str) -> str:
    lo, hi = r[f"{p}_iqr_ms"]
    return f"{r[f'{p}_ms']:.3f} [{lo:.3f}, {hi:.3f}]"


def _degree_cell(r: dict) -> str:
    if "degree" not in r:
        return ""
    used = r.get("degree_used")
    if r["degree"] == DYNAMIC:
        return f"dynamic ({used})" if used is not None else "dynamic"
    return str(r["degree"])


def _system_cell(r: dict) -> str:
    """The system; for magi also the kernel backend asked for (the kernel column says what it resolved to)."""
    return f"{r['system']} ({r['kernel_backend']})" if "kernel_backend" in r else r["system"]


def _skip_cell(reason: str) -> str:
    """The reason's head (before the first colon; for a failure, also the exception type), table-safe."""
    parts = reason.split(":")
    head = ":".join(parts[:2]) if parts[0] == "failed" else parts[0]
    return head.replace("|", "/").strip()


def markdown(meta: dict, rows: list[dict]) -> str:
    c = meta["config"]
    degrees = ",".join(str(x) for x in c["degrees"])
    lines = [f"{meta['date']} | {meta['world_size']} x {meta['device']} ({meta['backend']}) | torch {meta['torch']} | "
             f"triton {meta['triton']} | git {meta['git']} | heads {c['heads_q']}:{c['heads_kv']}, d {c['head_dim']}, "
             f"{c['dtype']} | magi chunk {c['chunk_size']}, degrees {degrees}, min chunk {c['min_chunk_size']}, "
             f"kernel backends {','.join(c['kernel_backends'])}, dK/dV reduce {c['grad_reduce']}, group collectives "
             f"{meta.get('grpcoll', 'a2av')} | varlen block {c['block_size']} | ms: median [p25, p75] of "
             f"{c['iters']} after {c['warmup'] + 1} warm-up, slowest rank per iteration | peak GiB: max over ranks "
             f"(in brackets: above the allocation at the start) | magi speedup: fastest other row's median / magi's", ""]  # fmt: skip
    body = []
    for r in rows:
        head = [r["tokens_per_gpu"], r["mask"], _system_cell(r), _degree_cell(r)]
        if "skipped" in r:
            body.append(head + [f"skipped: {_skip_cell(r['skipped'])}"] + [""] * 7)
            continue
        rel = f"{r['rel_out']:.1e} / {r['rel_dq']:.1e}" if "rel_out" in r else "n/a (magi not run)"
        mem = "n/a"
        if r.get("peak_mem_gib") is not None:
            mem = f"{r['peak_mem_gib']:.2f} (+{r['peak_mem_over_start_gib']:.2f})"
        speed = ""
        if "fwd_speedup" in r:
            speed = (f"{r['fwd_speedup']:.2f}x / {r['bwd_speedup']:.2f}x "
                     f"(vs {r['fwd_best_baseline']} / {r['bwd_best_baseline']})")  # fmt: skip
        body.append([*head, r["kernel"], _ms(r, "fwd"), _ms(r, "bwd"), f"{r['fwd_tflops']:.4g}",
                     f"{r['bwd_tflops']:.4g}", mem, speed, rel])  # fmt: skip
    lines += table(["tokens/GPU", "mask", "system", "degree", "kernel", "fwd ms", "bwd ms", "fwd TFLOP/s/GPU",
                    "bwd TFLOP/s/GPU", "peak GiB", "magi speedup fwd / bwd", "rel diff out / dq vs magi"],
                   body)  # fmt: skip
    return "\n".join(lines) + "\n"


def _parse_degrees(text: str) -> tuple[int | str, ...]:
    """``--degrees``: ints >= 0 and ``dynamic`` (any case), comma-separated."""
    items = [x.strip().lower() for x in text.split(",")]
    if bad := [x for x in items if x != DYNAMIC and not x.isdigit()]:
        raise ValueError(f"each entry must be an int >= 0 or 'dynamic', got {bad[0]!r}")
    return tuple(x if x == DYNAMIC else int(x) for x in items)


def add_arguments(ap) -> None:
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens-per-gpu", default="8192,16384", help="comma-separated")
    add_common(ap, masks=",".join(MASKS), heads="64:8", head_dim=128)
    ap.add_argument("--systems", default=",".join(s.value for s in System))
    ap.add_argument("--dtype", choices=sorted(common.DTYPES), default="bf16")
    ap.add_argument("--warmup", type=int, default=5, help="warm-up iterations after the checked first one")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--chunk-size", type=int, default=2048, help="magi DispatchConfig.chunk_size")
    ap.add_argument("--degree", default=None, help="alias of --degrees")
    ap.add_argument("--degrees", help="magi OverlapConfig.degree, comma-separated: ints >= 0 and/or "
                    "'dynamic' (one magi row each; default dynamic)")  # fmt: skip
    ap.add_argument("--min-chunk-size", type=int, default=512, help="magi OverlapConfig.min_chunk_size")
    ap.add_argument("--kernel-backend", default="auto", help="magi DistAttnConfig.kernel_backend, comma-separated "
                    f"(one magi row each) from {KERNEL_BACKENDS}")  # fmt: skip
    ap.add_argument("--grad-reduce", choices=("fp32", "bf16"), default="fp32", help="magi partial dK/dV reduce dtype")  # fmt: skip
    ap.add_argument("--grpcoll", choices=("env", "a2av", "native"), default="env", help="magi group collectives: "
                    "GrpCollConfig(native=...); env = MAGI_ATTENTION_NATIVE_GRPCOLL decides")  # fmt: skip
    ap.add_argument("--block-size", type=int, default=2048, help="varlen_block_causal: tokens per block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", metavar="DIR", help="profile one magi forward + backward per (tokens, mask) (the "
                    "first --degrees entry); rank 0 writes the top 25 ops by self device time to "
                    "DIR/profile_<mask>.txt (profile_<mask>_<tokens>.txt with several --tokens-per-gpu)")  # fmt: skip
    ap.add_argument("--out", default=None, help="path prefix: writes <out>.json and <out>.md")


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, str | None]:
    """``(config, --out)`` of a command line (``python -m benchmarks cp``'s arguments)."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return config(ap.parse_args(argv))


def config(a) -> tuple[BenchConfig, str | None]:
    """``(config, --out)`` of parsed arguments; a bad value exits with status 2 (`usage_error`)."""
    try:
        hq, hkv = (int(x) for x in a.heads.split(":"))
        systems = tuple(System(s) for s in a.systems.split(","))
    except ValueError as exc:
        usage_error(f"--heads must be Q:KV ints and --systems from {[s.value for s in System]}: {exc}")
    masks = tuple(a.masks.split(","))
    if bad := [m for m in masks if m not in MASKS]:
        usage_error(f"--masks: unknown {bad}, choose from {MASKS}")
    if a.degrees is not None and a.degree is not None:
        usage_error("give --degrees or its alias --degree, not both")
    try:
        degrees = _parse_degrees(a.degrees or a.degree or DYNAMIC)
    except ValueError as exc:
        usage_error(f"--degrees: {exc}")
    backends = tuple(b.strip() for b in a.kernel_backend.split(","))
    if bad := [b for b in backends if b not in KERNEL_BACKENDS]:
        usage_error(f"--kernel-backend: unknown {bad}, choose from {KERNEL_BACKENDS}")
    if a.block_size <= 0:
        usage_error(f"--block-size must be a positive int, got {a.block_size}")
    parsed = dict(tokens_per_gpu=tuple(int(x) for x in a.tokens_per_gpu.split(",")), masks=masks, systems=systems,
                  heads_q=hq, heads_kv=hkv, degrees=degrees, kernel_backends=backends)  # fmt: skip
    # every other field is the option of the same name
    cfg = BenchConfig(
        **{f.name: parsed[f.name] if f.name in parsed else getattr(a, f.name) for f in fields(BenchConfig)}
    )
    return cfg, a.out


def _profile_path(cfg: BenchConfig, mask: str, tpg: int) -> Path | None:
    if cfg.profile is None:
        return None
    name = f"profile_{mask}.txt" if len(cfg.tokens_per_gpu) == 1 else f"profile_{mask}_{tpg}.txt"
    return Path(cfg.profile) / name


def run(cfg: BenchConfig, out: str | None) -> list[dict]:
    """The whole benchmark on an initialised process group; returns the rows (every rank)."""
    device = torch.device("cpu")
    if cfg.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    # magi first (once per kernel backend and degree): the cross-check reference is the first magi row
    magi = System.MAGI in cfg.systems
    runs = [(System.MAGI, d, b) for b in cfg.kernel_backends for d in cfg.degrees] if magi else []
    runs += [(s, None, None) for s in cfg.systems if s != System.MAGI]
    rows = []
    for tpg in cfg.tokens_per_gpu:
        data = _global_data(tpg * dist.get_world_size(), cfg, device)
        for mask in cfg.masks:
            ref: dict = {}
            for i, (system, degree, backend) in enumerate(runs):
                prof = _profile_path(cfg, mask, tpg) if system == System.MAGI and i == 0 else None
                rows.append(run_case(system, mask, tpg, data, ref, cfg, device, degree, prof, backend or "auto"))  # fmt: skip
                if dist.get_rank() == 0:
                    r = rows[-1]
                    name = _system_cell(r) + (f" degree {_degree_cell(r)}" if system == System.MAGI else "")
                    status = r.get("skipped") or f"fwd {r['fwd_ms']:.3f} ms, bwd {r['bwd_ms']:.3f} ms ({r['kernel']})"  # fmt: skip
                    print(f"[cp_bench] {tpg}/GPU {mask} {name}: {status}", flush=True)
        del data
    add_speedups(rows)
    if dist.get_rank() == 0:
        meta = _meta(cfg, device)
        text = markdown(meta, rows)
        if out:
            prefix = Path(out.removesuffix(".json").removesuffix(".md"))
            write_results(prefix.parent, prefix.name, {"meta": meta, "rows": rows}, text)
        print(text, flush=True)
    return rows


def main(args) -> int:
    """``python -m benchmarks cp``: the process group (torchrun's environment) joined if not yet, then `run`."""
    cfg, out = config(args)
    own_group = not dist.is_initialized()
    if own_group:  # torchrun sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
        common.join_torchrun(cfg.device == "cuda")
    try:
        run(cfg, out)
    finally:
        if own_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
