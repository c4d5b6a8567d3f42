"""What this machine runs, whether it is correct here, and how fast: ``python -m magi_attention.info``
(also the ``magi-attention-info`` command).

Without options it prints the versions (Python, torch, Triton, CUDA, the driver, the vendor packages, ours),
the GPUs, per kernel backend (``fa4``, ``cudnn``, ``triton``, ``torch``) whether it runs here and why not,
the ``auto`` table in use, the variables in effect and the compiled-kernel caches with their sizes.

- ``--check``: every backend that runs here against dense float64 attention (``magi_ffa.testing``) on three
  small masks (causal, packed causal documents, a causal sliding window), forward (out, lse) and backward
  (dq, dk, dv). A check passes under the acceptance rule of the test suite
  (``magi_ffa.testing.assert_close_to_ref``): the error to float64 at most twice the error of the same
  computation done naively in the inputs' dtype, plus the dtype's rounding; the printed ratio is the worst
  ``error / naive error`` over the five tensors. On a GPU the inputs are bfloat16; on a CPU float32 (the
  Triton backend then runs in Triton's interpreter when ``TRITON_INTERPRET=1``, on tiny shapes).
- ``--bench`` (CUDA only): forward and backward TFLOP/s for causal, packed documents and a sliding window at
  8k and 32k tokens (64 query heads, 8 key/value heads, head_dim 128, bfloat16) of what users run:
  ``calc_attn`` at cp 1 with ``auto`` and with each backend (the key built once, outside the timing; the
  ``pick`` column names the backends it ran), each backend's kernel API (``<backend> kernel API``: its
  package's ``flex_flash_attn_func``, range tables as CUDA int32 tensors), and the vendors' own calls
  (FlashAttention-4, cuDNN's flex_attention) where installed. FLOPs(fwd) = 4 x mask area x heads_q x
  head_dim, FLOPs(bwd) = 2.5 x FLOPs(fwd); rounds interleave the runners, each cell is the median over
  rounds. ``--bench-all`` adds the Triton backend's rows and PyTorch's FlexAttention (their compiles take
  minutes; ``--bench`` fits in about two minutes with warm caches).
- ``--json``: one JSON document on stdout, nothing else.

The exit status is 0 unless a check that ran failed (1), or the arguments are wrong (2). Every line of the
text output fits in 80 columns, except a path or value longer than that: it stands whole on a line of its
own, so it can be copied.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata, resources

import torch

WIDTH = 80
BACKENDS = ("fa4", "cudnn", "triton", "torch")
DISTRIBUTIONS = (
    "torch",
    "triton",
    "numpy",
    "flash-attn-4",
    "nvidia-cudnn-frontend",
    "nvidia-cutlass-dsl",
    "magi-attention",
    "magi-solver",
    "magi-ffa",
    "magi-ffa-fa4",
    "magi-ffa-cudnn",
    "magi-group-collective",
    "magi-mask",
)
BENCH_SIZES = (8192, 32768)
BENCH_HEADS = (64, 8, 128)
"""(heads_q, heads_kv, head_dim) of ``--bench``: the shapes of docs/benchmarks/kernel_backends.md."""


# -- the report ---------------------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    """The installed distribution's version; for our packages imported from a source tree without being
    installed (a clone on ``PYTHONPATH``) the module's ``__version__`` marked ``(source)``; else None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    module = dist.replace("-", "_")
    if not dist.startswith("magi-") or importlib.util.find_spec(module) is None:
        return None
    return f"{importlib.import_module(module).__version__} (source)"


def _driver() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), None without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {"index": i, "name": p.name, "capability": f"sm{p.major}{p.minor}",
             "memory_gib": round(p.total_memory / 2**30, 1)}
        )  # fmt: skip
    return out


def backend_status() -> dict[str, str]:
    """Backend -> "" when it runs here, else why not (the runtime's own probes, ``_runtime.kernels``)."""
    from ._runtime.kernels import backend_missing

    return {name: backend_missing(name) for name in ("fa4", "cudnn", "triton", "torch")}


def _auto_table() -> dict:
    from magi_solver.kernel_choice import load_kernel_table

    from ._runtime.kernels import local_gpu_kind

    kind = local_gpu_kind()
    table = load_kernel_table(kind)
    path = resources.files("magi_solver").joinpath("kernel_tables", f"{kind}.json")
    if table is None:
        return {"gpu_kind": kind, "path": None, "rows": 0,
                "note": f"no table for {kind!r}: auto uses the capability rule"}  # fmt: skip
    return {"gpu_kind": kind, "path": str(path), "rows": len(table.rows), "source": table.source}


def _caches() -> list[dict]:
    from magi_ffa import env as ffa_env
    from magi_ffa.compile_cache import cache_report, dir_size

    root, how = ffa_env.cache_dir()
    out = [{"name": "root", "enabled": True, "directory": root, "how": how, "bytes": dir_size(root)}]
    for s in cache_report():
        size = dir_size(s.directory) if s.directory else 0
        out.append(
            {"name": s.name, "enabled": s.enabled, "directory": s.directory, "how": s.how, "bytes": size}
        )
    return out


def collect() -> dict:
    """Everything the plain report shows, as a JSON-able dict."""
    from . import env

    status = backend_status()  # imports our backend packages: their compile caches are decided here
    return {
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "torch_cuda": torch.version.cuda,
        "driver": _driver(),
        "versions": {d: _version(d) for d in DISTRIBUTIONS},
        "gpus": _gpus(),
        "backends": {b: {"runs": not why, "why_not": why} for b, why in status.items()},
        "auto_table": _auto_table(),
        "variables": env.variables_in_effect(),
        "caches": _caches(),
    }


# -- --check ------------------------------------------------------------------------------------------------
def _check_masks(total: int) -> list[tuple[str, list, list, list]]:
    from .vendors import standard_masks

    masks = standard_masks(total, window=total // 4)
    return [
        (m.name, [list(r) for r in m.q_ranges], [list(r) for r in m.k_ranges], list(m.types)) for m in masks
    ]


def kernel_fns(backend: str) -> tuple[Callable, Callable]:
    """``(fwd, bwd)`` of ``backend`` with ``magi_ffa.ffa_fwd`` / ``ffa_bwd``'s contract (the runtime's)."""
    from ._runtime.kernels import attn_kernel
    from .config import KernelBackend

    kernel = attn_kernel(KernelBackend(backend))
    return kernel.fwd, kernel.bwd


def _check_shape(backend: str, cuda: bool) -> tuple[int, int, int, int, torch.dtype]:
    """(tokens, heads_q, heads_kv, head_dim, dtype) of a check: small, GQA, the dtype users train in; on a
    CPU float32 and, for Triton's interpreter (~10 ms per tile step), tiny."""
    if cuda:
        return 512, 4, 2, 128, torch.bfloat16
    if backend == "triton":
        return 64, 2, 1, 16, torch.float32
    return 128, 2, 1, 32, torch.float32


def check_backend(backend: str) -> list[dict]:
    """One row per mask: passed, the worst error ratio, and the failure message when it failed."""
    from magi_ffa.testing import assert_close_to_ref, make_attn_mask, random_qkv, ref_attn

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    total, hq, hk, d, dtype = _check_shape(backend, cuda)
    fwd, bwd = kernel_fns(backend)
    rows = []
    for name, qr, kr, types in _check_masks(total):
        t0 = time.perf_counter()
        q, k, v = random_qkv(total, total, hq, hk, d, dtype, device, seed=1)
        do = random_qkv(total, total, hq, hk, d, dtype, device, seed=2)[0]
        mask = make_attn_mask(qr, kr, types, total, total)
        refs = {}
        for rdt in (torch.float64, dtype):
            leaves = [x.detach().to(rdt).requires_grad_() for x in (q, k, v)]
            out, lse = ref_attn(*leaves, mask)
            out.backward(do.to(rdt))
            refs[rdt] = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad,
                         "dv": leaves[2].grad}  # fmt: skip
        row = {"backend": backend, "mask": name, "tokens": total, "dtype": str(dtype).removeprefix("torch.")}
        try:
            qt, kt, tt = (torch.tensor(x, dtype=torch.int32, device=device) for x in (qr, kr, types))
            out, lse = fwd(q, k, v, qt, kt, tt)
            dq, dk, dv = bwd(do, q, k, v, out, lse, qt, kt, tt)
            got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
            ratio, failure = 0.0, ""
            for key, actual in got.items():
                ratio = max(ratio, _error_ratio(actual, refs[torch.float64][key], refs[dtype][key]))
                try:
                    assert_close_to_ref(key, actual, refs[torch.float64][key], refs[dtype][key], dtype)
                except AssertionError as exc:
                    failure = failure or str(exc)
            row.update(passed=not failure, ratio=round(ratio, 3), error=failure)
        except Exception as exc:  # a crash is a failed check, reported with its message
            row.update(passed=False, ratio=None, error=f"{type(exc).__name__}: {exc}")
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
    return rows


def _error_ratio(actual: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor) -> float:
    """max |actual - ref64| / max |ref_lp - ref64| over the finite entries (1.0 = as good as the naive
    computation in the same dtype; 0 when both are exact)."""
    a, r, lp = (x.detach().to(torch.float64).cpu() for x in (actual, ref64, ref_lp))
    fin = torch.isfinite(r)
    if not fin.any():
        return 0.0
    err = (a[fin] - r[fin]).abs().max().item()
    err_lp = (torch.nan_to_num(lp[fin], nan=0.0, posinf=0.0, neginf=0.0) - r[fin]).abs().max().item()
    if err != err:  # NaN
        return float("inf")
    return err / err_lp if err_lp > 0 else (0.0 if err == 0 else float("inf"))


def run_checks(status: dict[str, str]) -> dict:
    """Every backend that runs here, checked; the ones that cannot run are listed with the reason."""
    rows, skipped = [], {}
    for backend in BACKENDS:
        if status[backend]:
            skipped[backend] = status[backend]
            continue
        rows.extend(check_backend(backend))
    return {"rows": rows, "skipped": skipped, "passed": all(r["passed"] for r in rows)}


# -- --bench ------------------------------------------------------------------------------------------------
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
    from .api import magi_attn_flex_key
    from .config import DistAttnConfig

    total, hq, d = q.shape
    return magi_attn_flex_key(
        [list(r) for r in mask.q_ranges], [list(r) for r in mask.k_ranges], list(mask.types), total, total,
        hq, k.shape[1], d, None, DistAttnConfig(kernel_backend=backend),
    )  # fmt: skip


def _pick(key) -> list[str]:
    """``[forward, backward]`` backends ``calc_attn`` runs for ``key`` (bf16), as the runtime reports them."""
    from .api import get_kernel_backend

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
    from . import vendors as vk
    from .api import calc_attn

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
    from .api import clear_cache
    from .vendors import standard_masks

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


# -- text output (80 columns) -------------------------------------------------------------------------------
def _fit(line: str) -> str:
    """``line`` cut to the width with "...", unless it is one word (a path or value put on its own line
    by ``_wrap``: kept whole so that it can be copied)."""
    if len(line) <= WIDTH or " " not in line.strip():
        return line
    return line[: WIDTH - 3] + "..."


def _wrap(label: str, text: str, indent: int = 2) -> list[str]:
    """``label`` then the words of ``text`` filled to the width, continuation lines indented by four more.
    A word never splits: one too long for a continuation line (a cache path, a long value) goes on a line of
    its own, whole and unindented, so it can be copied as it is."""
    first, cont = " " * indent + label, " " * (indent + 4)
    lines: list[str] = []
    cur, fresh = first, True
    for word in text.split():
        joined = cur + ("" if fresh else " ") + word
        if len(joined) <= WIDTH:
            cur, fresh = joined, False
            continue
        if cur.strip():  # the line so far (with the label) is done
            lines.append(cur)
        if len(cont + word) <= WIDTH:
            cur, fresh = cont + word, False
        else:
            lines.append(word)
            cur, fresh = cont, True
    if cur.strip():
        lines.append(cur)
    return lines or [first]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def render(report: dict) -> str:
    """The report as text, every line at most 80 columns."""
    lines = ["magi-attention info", ""]
    lines.append(f"Python {report['python']}  ({report['platform']})")
    cuda = report["torch_cuda"] or "none (CPU build of torch)"
    lines += _wrap("", f"CUDA (torch build): {cuda}; driver: {report['driver'] or 'none'}", 0)
    lines.append("Packages:")
    for dist, ver in report["versions"].items():
        lines.append(f"  {dist:<24}{ver or 'not installed'}")
    lines.append("GPUs:")
    if not report["gpus"]:
        lines.append("  none (no CUDA device visible to torch)")
    for g in report["gpus"]:
        lines.append(_fit(f"  [{g['index']}] {g['name']}, {g['capability']}, {g['memory_gib']} GiB"))
    lines.append("Kernel backends:")
    for name, b in report["backends"].items():
        lines += _wrap(f"{name:<7}", "runs here" if b["runs"] else "no: " + b["why_not"])
    t = report["auto_table"]
    lines.append(f"auto (GPU kind {t['gpu_kind']!r}):")
    if t["path"]:
        lines += _wrap("", f"{t['rows']} measured rows from {t['path']}")
    else:
        lines += _wrap("", t["note"])
    lines.append("Variables in effect:")
    if not report["variables"]:
        lines.append("  none set")
    for k, v in report["variables"].items():
        lines += _wrap("", f"{k}={v}")
    lines.append("Compiled-kernel caches:")
    for c in report["caches"]:
        state = _size(c["bytes"]) if c["enabled"] or c["name"] == "root" else "off"
        lines += _wrap(f"{c['name']:<7}", f"{state}, {c['directory'] or '-'} ({c['how']})")
    if "check" in report:
        lines += ["", *_render_check(report["check"])]
    if "bench" in report:
        lines += ["", *_render_bench(report["bench"])]
    return "\n".join(_fit(x) for x in lines)


def _render_check(check: dict) -> list[str]:
    lines = ["Check against float64 (ratio: error / naive error in the same dtype;",
             "  pass: at most 2x the naive error plus the dtype's rounding):"]  # fmt: skip
    lines.append(f"  {'backend':<8}{'mask':<8}{'tokens':>7}  {'dtype':<9}{'ratio':>7}  {'result':<7}{'s':>6}")
    for r in check["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"  {r['backend']:<8}{r['mask']:<8}{r['tokens']:>7}  {r['dtype']:<9}{ratio:>7}  "
            f"{'pass' if r['passed'] else 'FAIL':<7}{r['seconds']:>6.1f}"
        )
        if not r["passed"]:
            lines += _wrap("", r["error"], 4)
    for b in check["skipped"]:
        lines.append(f"  {b:<8}not checked: it cannot run here (see Kernel backends)")
    lines.append("All checks passed." if check["passed"] else "SOME CHECKS FAILED.")
    return lines


def _render_bench(bench: dict) -> list[str]:
    if bench.get("skipped"):
        return _wrap("Bench: ", "not run: " + bench["skipped"], 0)
    hq, hk, d = bench["heads"]
    lines = [f"TFLOP/s fwd / bwd, bf16, heads {hq}:{hk}, head_dim {d} (x: vs auto)"]
    lines += _wrap("", "auto and each backend: calc_attn at cp 1 (pick: the backends it ran, forward / "
                   "backward); kernel API: the backend's flex_flash_attn_func; the rest: the vendors' "
                   "own calls.", 0)  # fmt: skip
    lines.append(
        f"  {'mask':<7}{'tokens':>6}  {'runner':<17}{'fwd':>6}{'bwd':>6}{'fwd x':>6}{'bwd x':>6}  pick"
    )
    for row in bench["rows"]:
        auto = row["cells"].get("auto")
        order = ["auto"] + [n for n in row["cells"] if n != "auto"] if auto else list(row["cells"])
        for i, name in enumerate(order):
            c = row["cells"][name]
            fx = f"{c['fwd_tflops'] / auto['fwd_tflops']:.2f}" if auto else "-"
            bx = f"{c['bwd_tflops'] / auto['bwd_tflops']:.2f}" if auto else "-"
            pick = "/".join(c.get("pick", []))
            head = f"{row['mask']:<7}{row['tokens'] // 1024:>5}k" if i == 0 else " " * 13
            lines.append(
                f"  {head}  {name:<17}{c['fwd_tflops']:>6.0f}{c['bwd_tflops']:>6.0f}{fx:>6}{bx:>6}  {pick}"
            )
    for name, why in bench.get("unavailable", {}).items():
        lines += _wrap(f"{name}: ", why)
    return lines


# -- the command --------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m magi_attention.info [--check] [--bench | --bench-all] [--json]``; returns the exit
    status."""
    parser = argparse.ArgumentParser(
        prog="python -m magi_attention.info",
        description="What this machine runs (versions, GPUs, kernel backends, caches); --check "
        "checks each backend against float64, --bench times them (CUDA).",
    )
    parser.add_argument("--check", action="store_true", help="check every backend against float64")
    parser.add_argument("--bench", action="store_true", help="forward / backward TFLOP/s (CUDA only)")
    parser.add_argument(
        "--bench-all", action="store_true",
        help="--bench with the Triton backend's rows and FlexAttention too (their compiles take minutes)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON document, nothing else")
    parser.add_argument("--rounds", type=int, default=3, help="--bench rounds per cell (median; default 3)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    t0 = time.perf_counter()
    # with --json, stdout carries the document only: anything printed meanwhile (vendor logs) goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        report = collect()
        status = {b: v["why_not"] for b, v in report["backends"].items()}
        code = 0
        if args.check:
            report["check"] = run_checks(status)
            code = 0 if report["check"]["passed"] else 1
        if args.bench or args.bench_all:
            report["bench"] = run_bench(status, rounds=args.rounds, every=args.bench_all)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print(render(report))
        print(f"({report['seconds']} s)")
    return code


def console_main() -> None:
    """The ``magi-attention-info`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
