"""``--bench`` (CUDA only): forward and backward TFLOP/s of ``calc_attn`` at cp 1 (``auto`` and each
backend), each backend's kernel API and the vendors' own calls, on causal, packed documents and a sliding
window; see ``magi_attention.info`` for the shapes and the FLOP count."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

__all__ = ["BENCH_HEADS", "BENCH_SIZES", "KERNEL_API", "run_bench"]

BENCH_SIZES = (8192, 32768)
BENCH_HEADS = (64, 8, 128)
"""(heads_q, heads_kv, head_dim) of ``--bench``: the shapes of docs/benchmarks/kernel_backends.md."""


def _time_ms(fn: Callable[[], None], rep_ms: float) -> float:
    """Median milliseconds of ``fn`` (CUDA events; warm-up calls first, then as many as fit ``rep_ms``)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    n = max(3, min(100, int(rep_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


KERNEL_API = " kernel API"
"""Suffix of the rows that time a backend package's own ``flex_flash_attn_func`` (the per-call kernel API)."""


def _key(mask, q, k, backend: str):
    """The runtime key of ``mask`` at cp 1 (one process, no process group) with ``kernel_backend=backend``:
    what a training script builds once per mask, outside the timing."""
    from ..api import magi_attn_flex_key
    from ..config import DistAttnConfig

    total, hq, d = q.shape
    return magi_attn_flex_key(
        [list(r) for r in mask.q_ranges], [list(r) for r in mask.k_ranges], list(mask.types), total, total,
        hq, k.shape[1], d, None, DistAttnConfig(kernel_backend=backend),
    )  # fmt: skip


def _pick(key) -> list[str]:
    """``[forward, backward]`` backends ``calc_attn`` runs for ``key`` (bf16), as the runtime reports them."""
    from ..api import get_kernel_backend

    backend, reason = get_kernel_backend(key)
    backward = reason.rpartition("backward: ")[2] if "; backward: " in reason else backend.value
    return [backend.value, backward]


def _bench_runners(mask, q, k, v, available: dict[str, str], every: bool) -> tuple[dict, dict, dict]:
    """``(runners, missing, picks)``: name -> (fn, leaves) for every runner that can take ``mask`` here,
    name -> why not for the rest, name -> the backends ``calc_attn`` runs for the ``calc_attn`` rows.

    Rows: ``auto`` and each backend through ``calc_attn`` at cp 1 (the key built here, outside the timing),
    each backend's kernel API (``<backend> kernel API``: its package's ``flex_flash_attn_func``, range tables
    as CUDA int32 tensors), and the vendors' own calls. The Triton backend and FlexAttention (whose compiles
    take minutes) only with ``every``."""
    from .. import vendors as vk
    from ..api import calc_attn

    backends = ("fa4", "cudnn", "triton") if every else ("fa4", "cudnn")
    qt, kt, tt = (
        torch.tensor(x, dtype=torch.int32, device=q.device)
        for x in (mask.q_ranges, mask.k_ranges, mask.types)
    )
    table: list[tuple[str, str, object]] = [(b, "calc_attn", b) for b in ("auto", *backends)]
    table += [(b + KERNEL_API, "kernel", b) for b in backends]
    table += [("FA4 native", "vendor", vk.fa4_call), ("cuDNN flex", "vendor", vk.cudnn_flex_call)]
    if every:
        table.append(("FlexAttn", "vendor", vk.flex_attention_call))
    runners, missing, picks = {}, {}, {}
    for name, kind, what in table:
        try:
            if kind == "vendor":
                runners[name] = what(mask, q, k, v)
                continue
            if what != "auto" and available[what]:
                missing[name] = "cannot run here (see Kernel backends)"
                continue
            leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
            if kind == "calc_attn":
                key = _key(mask, q, k, what)
                picks[name] = _pick(key)
                fn = lambda key=key, leaves=leaves: calc_attn(*leaves, key)[0]  # noqa: E731
            else:
                fn = _kernel_api_call(what, leaves, qt, kt, tt)
            runners[name] = (fn, leaves)
        except vk.VendorUnavailable as exc:
            missing[name] = str(exc)[:160]
        except Exception as exc:  # a runner that fails here is reported, never hidden
            missing[name] = f"{type(exc).__name__}: {exc}"[:160]
    return runners, missing, picks


def _kernel_api_call(backend: str, leaves, qt, kt, tt) -> Callable[[], torch.Tensor]:
    """``backend``'s kernel API, ``flex_flash_attn_func`` of magi_ffa_fa4 / magi_ffa_cudnn / magi_ffa
    (Triton), on ``leaves`` and the range tables; cuDNN's mask plan built here, outside the timing."""
    import magi_ffa

    q, k, v = leaves
    if backend == "fa4":
        import magi_ffa_fa4

        return lambda: magi_ffa_fa4.flex_flash_attn_func(q, k, v, qt, kt, tt)[0]
    if backend == "cudnn":
        import magi_ffa_cudnn

        magi_ffa_cudnn.get_mask_plan(q, k, qt, kt, tt)  # the mask plan outside the timing
        return lambda: magi_ffa_cudnn.flex_flash_attn_func(q, k, v, qt, kt, tt)[0]
    return lambda: magi_ffa.flex_flash_attn_func(q, k, v, qt, kt, tt)[0]


def run_bench(status: dict[str, str], rounds: int = 3, rep_ms: float = 40.0,
              sizes: Sequence[int] = BENCH_SIZES, every: bool = False) -> dict:  # fmt: skip
    """Forward / backward TFLOP/s per (mask, size, runner); see the module docstring. ``every``: also the
    Triton backend's rows and FlexAttention (``--bench-all``)."""
    if not torch.cuda.is_available():
        return {"skipped": "needs a CUDA GPU (none here)", "rows": []}
    from ..api import clear_cache
    from ..vendors import standard_masks

    hq, hk, d = BENCH_HEADS
    rows, notes = [], {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for size in sizes:
        for mask in standard_masks(size):
            q, k, v = (torch.randn(size, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                       for h in (hq, hk, hk))  # fmt: skip
            do = torch.randn(size, hq, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            runners, missing, picks = _bench_runners(mask, q, k, v, status, every)
            for name, why in missing.items():
                notes.setdefault(name, why)
            fwd_ms: dict[str, list[float]] = {n: [] for n in runners}
            bwd_ms: dict[str, list[float]] = {n: [] for n in runners}
            names = list(runners)
            for r in range(rounds):  # each round starts one runner later: drifts hit every runner alike
                shift = r % max(len(names), 1)
                for name in names[shift:] + names[:shift]:
                    fn, leaves = runners[name]
                    try:
                        g = do if fn().shape == do.shape else do.transpose(0, 1)[None]
                        f = _time_ms(fn, rep_ms)
                        fb = _time_ms(
                            lambda fn=fn, leaves=leaves, g=g: torch.autograd.grad(fn(), leaves, g), rep_ms
                        )
                    except Exception as exc:  # reported, the others go on
                        notes.setdefault(name, f"{type(exc).__name__}: {exc}"[:200])
                        runners.pop(name)
                        names.remove(name)
                        continue
                    fwd_ms[name].append(f)
                    bwd_ms[name].append(max(fb - f, 1e-6))
            flops = 4.0 * mask.area() * hq * d
            cells = {}
            for name in runners:
                fm, bm = statistics.median(fwd_ms[name]), statistics.median(bwd_ms[name])
                cells[name] = {"fwd_ms": round(fm, 4), "bwd_ms": round(bm, 4),
                               "fwd_tflops": round(flops / fm / 1e9, 1),
                               "bwd_tflops": round(2.5 * flops / bm / 1e9, 1)}  # fmt: skip
            for name, pick in picks.items():
                if name in cells:
                    cells[name]["pick"] = pick
            rows.append({"mask": mask.name, "tokens": size, "area": mask.area(), "cells": cells})
            del q, k, v, do, runners
            clear_cache()  # this mask's plans (cp 1) and the memory they hold
            torch.cuda.empty_cache()
    return {"rows": rows, "unavailable": notes, "heads": list(BENCH_HEADS), "dtype": "bfloat16"}
