"""How long the first training step takes in a fresh process, with a cold and a warm compile cache.
What it measures and how to run it: docs/benchmarks/cases.md (first-step)."""

import argparse
import builtins
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

# no torch at module level: the breakdown's child times `import torch` itself (benchmarks.common imports it)
from benchmarks.cli import ROOT, add_common, run_module, usage_error, write_results

TOKENS = 16384
HEADS = (64, 8, 128)
DEVICE = "cuda"
RUNS = ("cp1", "cp1", "cp1_warmup", "sim8", "sim8", "sim8_warmup")
"""The order of the runs; the first run of each kind on its cache directory is cold, the others warm."""
BREAKDOWN = ("auto", "fa4", "cudnn")
VENDORS = ("flash_attn", "cudnn", "cutlass", "quack")
"""The vendors' top-level modules, whose imports the breakdown times apart."""


class _Docs:
    """Packed causal documents of lengths cycling 1/8, 1/4, 1/16, 1/16 of the tokens (``info --bench``'s
    ``docs``), or in the reverse order (``second``: a new mask of the same kind)."""

    def __init__(self, second: bool = False) -> None:
        lengths, cycle = [], (16, 16, 4, 8) if second else (8, 4, 16, 16)
        while sum(lengths) < TOKENS:
            lengths.append(min(TOKENS // cycle[len(lengths) % 4], TOKENS - sum(lengths)))
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        self.q_ranges = self.k_ranges = [[a, a + n] for a, n in zip(starts, lengths, strict=True)]
        self.types = [1] * len(lengths)


def _dtype():
    import torch

    return torch.bfloat16 if DEVICE == "cuda" else torch.float32  # CPU smoke runs: the torch path in fp32


def _start():
    """CUDA start-up (not timed)."""
    import torch

    if DEVICE == "cuda":
        torch.cuda.init()
        torch.ones(1, device="cuda").sum().item()


def _key(api, backend: str, second: bool = False):
    """The runtime key (``api``: the imported magi_attention) of the docs mask (`_Docs`) on ``backend``."""
    m, (hq, hk, d) = _Docs(second), HEADS
    return api.magi_attn_flex_key(m.q_ranges, m.k_ranges, m.types, TOKENS, TOKENS, hq, hk, d, None,
                                  api.DistAttnConfig(kernel_backend=backend))  # fmt: skip


def _inputs(grad: bool, gen=None) -> list:
    """Random ``[q, k, v, dout]`` of the run's shape, drawn in that order (q, k, v leaves when ``grad``)."""
    import torch

    hq, hk, d = HEADS
    xs = [torch.randn(TOKENS, h, d, device=DEVICE, generator=gen, dtype=_dtype()) for h in (hq, hk, hk, hq)]
    return [x.requires_grad_(grad) for x in xs[:3]] + xs[3:]


def _timed_steps(out: dict, step: Callable[[], object], warm: Callable[[], object] | None) -> dict:
    """``out`` with ``warmup_s`` (``warm``'s seconds, if given), ``first_step_s`` (the first of three calls of
    ``step``) and ``steady_step_s`` (the fastest of the other two); device work waited for."""
    import torch

    from benchmarks import common

    device = torch.device(DEVICE)
    if warm is not None:
        out["warmup_s"] = common.times_ms(warm, 1, device=device)[0] / 1e3
    steps = [t / 1e3 for t in common.times_ms(step, 3, device=device)]
    out.update(first_step_s=steps[0], steady_step_s=min(steps[1:]))
    return out


def child_cp1(warm: bool) -> dict:
    import torch

    import magi_attention
    from magi_attention import calc_attn, get_kernel_backend, warmup

    _start()
    key = _key(magi_attention, "auto")
    q, k, v, do = _inputs(True, torch.Generator(device=DEVICE).manual_seed(0))
    resolved, reason = get_kernel_backend(key)
    out = {"backend": getattr(resolved, "value", str(resolved)), "reason": reason}
    return _timed_steps(out, lambda: calc_attn(q, k, v, key)[0].backward(do),
                        (lambda: warmup(key, _dtype(), device=DEVICE)) if warm else None)  # fmt: skip


def child_sim8(warm: bool) -> dict:
    import numpy as np
    import torch

    from magi_attention.simulate import auto_launchers, simulate_dist_attn
    from magi_solver import PlanOptions, plan_attention

    _start()
    m, d, cp = _Docs(), HEADS[2], 8
    qr, kr, types = [list(r) for r in m.q_ranges], [list(r) for r in m.k_ranges], list(m.types)
    chunk = TOKENS // cp // 4  # 4 chunks per rank (512 tokens at 16k)
    options = PlanOptions(overlap_degree=2, min_chunk_size=min(256, chunk))
    plan = plan_attention(qr, kr, types, TOKENS, cp, chunk_size=chunk, options=options)
    rows = [np.asarray(plan.dispatch.position_ids(r)) for r in range(cp)]
    kern, reason = auto_launchers(qr, kr, types, rows, plan.kv_layout, d)
    q, k, v, do = _inputs(False, torch.Generator(device=DEVICE).manual_seed(0))
    out = {"backend": str(kern.backend), "reason": reason}
    # warm: one step on other inputs, what magi_attention.warmup does on a real cp 8 key
    return _timed_steps(out, lambda: simulate_dist_attn(q, k, v, do, plan, kernel_backend=kern.backend),
                        (lambda: simulate_dist_attn(q * 0.5, k, v, do, plan, kernel_backend=kern.backend))
                        if warm else None)  # fmt: skip


class _VendorClock:
    """Seconds spent importing the vendors (``VENDORS``), wherever the import statement is: the outermost
    vendor import is timed (what it imports in turn, ``torch._dynamo`` included, counts as the vendor's)."""

    def __init__(self) -> None:
        self.seconds, self.loaded, self._busy = 0.0, set(), False
        self._real = builtins.__import__
        builtins.__import__ = self._import

    def _import(self, name, globals=None, locals=None, fromlist=(), level=0):
        root = name.split(".")[0]
        if level or self._busy or root not in VENDORS or root in sys.modules:
            return self._real(name, globals, locals, fromlist, level)
        self._busy, t0 = True, time.perf_counter()
        try:
            return self._real(name, globals, locals, fromlist, level)
        finally:
            self._busy, self.seconds = False, self.seconds + time.perf_counter() - t0
            self.loaded.add(root)


def child_breakdown(backend: str) -> dict:
    """One fresh process from its launch to the end of a second mask's step (see the module docstring)."""
    launch = float(os.environ["MAGI_FIRST_STEP_LAUNCH"])
    out: dict = {"backend_requested": backend, "python_s": time.time() - launch}
    clock = _VendorClock()
    stages: list[tuple[str, Callable[[], object]]] = []
    state: dict = {}

    def imports_ours():
        import magi_attention

        state["api"] = magi_attention

    def key(second: bool = False):
        state["key"] = _key(state["api"], backend, second)

    def inputs():  # a new q / k / v / dout (not ours: timed as a stage of its own)
        import torch

        *state["qkv"], state["do"] = _inputs(True)
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    def step():
        import torch

        state["api"].calc_attn(*state["qkv"], state["key"])[0].backward(state["do"])
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    stages = [("import_torch_s", lambda: __import__("torch")), ("import_ours_s", imports_ours),
              ("cuda_start_s", _start), ("inputs_s", inputs), ("first_key_s", key), ("first_step_s", step),
              ("second_key_s", lambda: key(True)), ("inputs_s", inputs), ("second_step_s", step)]  # fmt: skip
    for name, fn in stages:
        before, t0 = clock.seconds, time.perf_counter()
        fn()
        vendor = clock.seconds - before
        out[name] = out.get(name, 0.0) + time.perf_counter() - t0 - vendor
        out["vendor_import_s"] = out.get("vendor_import_s", 0.0) + vendor
        if name == "first_step_s":
            out["launch_to_first_backward_s"] = time.time() - launch
    resolved, reason = state["api"].get_kernel_backend(state["key"])
    out.update(backend=getattr(resolved, "value", str(resolved)), reason=reason, vendors=sorted(clock.loaded))
    out["ours_s"] = out["import_ours_s"] + out["first_key_s"] + out["first_step_s"]
    return out


def child_imports(modules: str) -> dict:
    """Launch to the end of importing ``modules`` (comma-separated, in order) in a fresh process."""
    import importlib

    launch = float(os.environ["MAGI_FIRST_STEP_LAUNCH"])
    for m in modules.split(","):
        importlib.import_module(m)
    return {"launch_to_imported_s": time.time() - launch}


def run_child(kind: str, cache: str, timeout: int, shape: list[str]) -> dict:
    from magi_ffa.compile_cache import dir_size

    env = dict(os.environ, MAGI_ATTENTION_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    for name in ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "FLEX_ATTENTION_CUTE_DSL_CACHE_DIR",
                 "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED"):  # fmt: skip
        env.pop(name, None)  # ours decide: the point is the default
    t0 = time.perf_counter()
    env["MAGI_FIRST_STEP_LAUNCH"] = repr(time.time())
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "first-step", "--child", kind, *shape], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"kind": kind, "error": proc.stderr[-3000:], "process_s": wall}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(kind=kind, process_s=round(wall, 2), cache_bytes=dir_size(cache))
    return result


def add_arguments(parser) -> None:
    add_common(parser, tokens=TOKENS, out_dir=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per child process")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (fp32)")
    parser.add_argument("--heads", default=",".join(map(str, HEADS)), help="heads_q,heads_kv,head_dim")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"runs in order (default {','.join(RUNS)}; "
                        "'' for none)")  # fmt: skip
    parser.add_argument("--breakdown", default=",".join(BREAKDOWN), help="backends of the from-launch breakdown, "
                        f"each cold then warm (default {','.join(BREAKDOWN)}; '' for none)")  # fmt: skip
    parser.add_argument("--vendor-baseline", default="cudnn.flex_attention",
                        help="module whose import after torch's is timed in a fresh process ('' for none)")  # fmt: skip


def main(args) -> None:
    global TOKENS, HEADS, DEVICE
    TOKENS, DEVICE = args.tokens, args.device
    HEADS = tuple(int(x) for x in args.heads.split(","))
    if len(HEADS) != 3 or TOKENS % 128:
        usage_error("--heads needs three integers and --tokens a multiple of 128")
    shape = ["--device", DEVICE, "--tokens", str(TOKENS), "--heads", args.heads]
    runs = [r for r in args.runs.split(",") if r]
    if any(r not in RUNS for r in runs):
        usage_error(f"--runs takes names among {sorted(set(RUNS))}")
    breakdown = [b for b in args.breakdown.split(",") if b]
    if args.child:
        kind, _, arg = args.child.partition(":")
        fn = {"cp1": lambda: child_cp1(False), "cp1_warmup": lambda: child_cp1(True),
              "sim8": lambda: child_sim8(False), "sim8_warmup": lambda: child_sim8(True),
              "breakdown": lambda: child_breakdown(arg), "imports": lambda: child_imports(arg)}[kind]  # fmt: skip
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
        breakdown_out = _run_breakdown(breakdown, args, tmp, shape)
    import torch

    doc = {"date": time.strftime("%Y-%m-%d", time.gmtime()),
           "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)", "tokens": TOKENS,
           "heads": list(HEADS), "mask": "docs (packed causal documents)", "runs": runs_out, **breakdown_out}  # fmt: skip
    path = write_results(args.out_dir, "first_step", doc)
    print(f"{'run':<12}{'cache':<6}{'backend':<16}{'warmup s':>9}{'first s':>9}{'steady s':>9}{'cache MiB':>10}")  # fmt: skip
    for r in runs_out:
        if "error" in r:
            print(f"{r['kind']:<12}{r['cache']:<6}error: {r['error'].splitlines()[-1][:50]}")
            continue
        w = f"{r['warmup_s']:.2f}" if "warmup_s" in r else "-"
        print(f"{r['kind']:<12}{r['cache']:<6}{r['backend'][:15]:<16}{w:>9}{r['first_step_s']:>9.2f}"
              f"{r['steady_step_s']:>9.3f}{r['cache_bytes'] / 2**20:>10.1f}")  # fmt: skip
    _print_breakdown(breakdown_out)
    print(f"wrote {path}")
    failed = [r for r in [*runs_out, *breakdown_out["breakdown"], *breakdown_out["imports"]] if "error" in r]
    sys.exit(1 if failed else 0)


def _run_breakdown(backends: list[str], args, tmp: str, shape: list[str]) -> dict:
    """The breakdown's runs (each backend cold then warm on its own fresh cache directory) and the fresh
    processes that import torch alone and torch + the vendor baseline."""
    rows = []
    for backend in backends:
        cache = os.path.join(tmp, f"breakdown_{backend}")
        for cold in ("cold", "warm"):
            r = run_child(f"breakdown:{backend}", cache, args.timeout, shape)
            r["cache"] = cold
            rows.append(r)
            print(json.dumps(r), flush=True)
    imports = []
    if backends:
        for modules in ["torch", *([f"torch,{args.vendor_baseline}"] if args.vendor_baseline else [])]:
            r = run_child(f"imports:{modules}", os.path.join(tmp, "imports"), args.timeout, shape)
            r["modules"] = modules
            imports.append(r)
            print(json.dumps(r), flush=True)
    return {"breakdown": rows, "imports": imports}


def _print_breakdown(doc: dict) -> None:
    """The breakdown as a table: seconds per stage, vendors' imports apart."""
    cols = ["python_s", "import_torch_s", "import_ours_s", "cuda_start_s", "vendor_import_s", "first_key_s",
            "first_step_s", "second_key_s", "second_step_s", "ours_s", "launch_to_first_backward_s"]  # fmt: skip
    heads = ["python", "torch", "ours", "cuda", "vendors", "key", "fwd+bwd", "key 2", "step 2", "OURS", "total"]  # fmt: skip
    if doc["breakdown"]:
        print("\nfrom process launch, seconds (vendors' imports apart; OURS = ours + key + fwd+bwd; total = "
              "launch to the end of the first backward)")  # fmt: skip
        print(f"{'backend':<16}{'cache':<6}" + "".join(f"{h:>8}" for h in heads))
    for r in doc["breakdown"]:
        name = r["kind"].partition(":")[2]
        if "error" in r:
            print(f"{name:<16}{r['cache']:<6}error: {r['error'].splitlines()[-1][:60]}")
            continue
        label = f"{name}->{r['backend']}" if name == "auto" else name
        print(f"{label[:15]:<16}{r['cache']:<6}" + "".join(f"{r[c]:>8.2f}" for c in cols))
    for r in doc["imports"]:
        t = f"{r['launch_to_imported_s']:.2f} s" if "error" not in r else "error"
        print(f"fresh process, launch to `import {r['modules'].replace(',', '` + `import ')}`: {t}")


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
