"""A training loop's view of the kernels: a new mask every step, step times and compiled-kernel caches.
What it measures and how to run it: docs/benchmarks/cases.md (mask-loop)."""

import itertools
import math
import random
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.cli import add_common, heads, run_module, write_results
from benchmarks.common import profile_table, rank_kernel_calls, times_ms

KINDS = ("random", "docs_causal", "stripes", "docs_full", "window", "prefix_docs", "short_docs")
SLOW_RATIO = 1.5  # a step slower than this times the median misses the timing target
COMPILE_S = 0.25  # a rank's step this much slower than its own re-run compiled something
SAME_AREA = 0.1  # --same-area: a step's mask area within this fraction of its kind's first mask


# ------------------------------------------------------------------------------------------------ masks
def _docs(total: int, rng: random.Random, n: int) -> list[list[int]]:
    """``n`` documents of log-normal lengths covering ``[0, total)`` (``magi_solver.demo.varlen_doc_lengths``,
    seeded from the step's ``rng``)."""
    from magi_solver.demo import varlen_doc_lengths

    cu = [0, *itertools.accumulate(varlen_doc_lengths(total, n, seed=rng.randrange(1 << 30)))]
    return [list(doc) for doc in itertools.pairwise(cu)]


def make_mask(step: int, total: int, seed: int, kinds=KINDS) -> tuple[str, list, list, list]:
    """The mask of ``step``: ``(kind, q_ranges, k_ranges, types)`` over ``total`` tokens, ``kinds`` in turn."""
    rng = random.Random(seed * 100_003 + step)
    kind = kinds[step % len(kinds)]
    if kind == "random":  # random overlapping slices of all four types
        from magi_ffa.testing import random_overlapping_slices

        qr, kr, tm = random_overlapping_slices(rng, total, total, rng.randint(4, 40))
        keep = [i for i in range(len(qr)) if qr[i][1] > qr[i][0] and kr[i][1] > kr[i][0]]
        return kind, [qr[i] for i in keep], [kr[i] for i in keep], [tm[i] for i in keep]
    if kind in ("docs_causal", "docs_full", "short_docs"):
        docs = _docs(total, rng, rng.randint(3, 12) if kind != "short_docs" else total // rng.randint(64, 200))  # fmt: skip
        return kind, docs, docs, [0 if kind == "docs_full" else 1] * len(docs)
    if kind == "stripes":  # overlapping row bands over narrow key bands: several intervals per row
        n = rng.randint(3, 9)
        qr = [[rng.randint(0, total // 8), total - rng.randint(0, total // 8)] for _ in range(n)]
        kr = [[s * total // n, s * total // n + rng.randint(16, max(17, total // (4 * n)))] for s in range(n)]
        return kind, qr, kr, [0] * (n - 1) + [rng.choice([1, 2, 3])]
    if kind == "window":  # a sliding window: its causal head and its band
        w = rng.randint(64, total // 4)
        return kind, [[0, w], [w, total]], [[0, w], [1, total]], [1, 3]
    p = rng.randint(total // 32, total // 8)  # documents that also see a shared prefix
    docs = [[a + p, b + p] for a, b in _docs(total - p, rng, rng.randint(2, 8))]
    return kind, docs + docs, docs + [[0, p]] * len(docs), [1] * len(docs) + [0] * len(docs)


def loop_masks(steps: int, total: int, seed: int, kinds=KINDS, same_area: bool = False) -> list[tuple]:
    """The masks of ``steps`` timed steps. ``same_area``: every mask of a kind redrawn (other seeds) until its
    area is within ``SAME_AREA`` of that kind's first mask: new values and counts every step, the same work,
    as a training loop's packs of a fixed token count (so the 1.5x-median target measures the new-mask cost
    and not how much work each mask holds)."""
    from benchmarks.common import mask_area

    out, ref = [], {}
    for i in range(steps):
        mask = make_mask(i, total, seed, kinds)
        if same_area:
            kind, area = mask[0], mask_area(*mask[1:])
            ref.setdefault(kind, area)
            best = (abs(area / ref[kind] - 1), mask)
            for j in range(1, 400):
                if best[0] <= SAME_AREA:
                    break
                cand = make_mask(i + j * 1000 * len(kinds), total, seed, kinds)  # the same kind, other draws
                best = min(best, (abs(mask_area(*cand[1:]) / ref[kind] - 1), cand), key=lambda x: x[0])
            mask = best[1]
        out.append(mask)
    return out


# ------------------------------------------------------------------------------------------- caches
_CACHE_MODULES = (("flash_attn.cute", "fa4"), ("cudnn.flex_attention", "cudnn"), ("magi_ffa", "triton"))


def cache_entries() -> dict[str, int]:
    """Compiled kernels held in this process: FA4's and cuDNN's JIT caches (every ``*Cache`` object with a
    ``cache`` dict their modules hold, directly or as a function's ``compile_cache``), and the Triton kernels
    of magi_ffa (``device_caches``). Modules not imported count 0."""
    out = {"fa4": 0, "cudnn": 0, "triton": 0}
    seen: set[int] = set()
    for name, mod in list(sys.modules.items()):
        group = next((g for prefix, g in _CACHE_MODULES if name.startswith(prefix)), None)
        if group is None or mod is None:
            continue
        try:
            objs = list(vars(mod).values())
        except TypeError:  # not a plain module
            continue
        for obj in objs:
            try:
                if group == "triton":
                    caches = getattr(obj, "device_caches", None)
                    if isinstance(caches, dict) and id(obj) not in seen:
                        seen.add(id(obj))
                        out[group] += sum(len(c[0]) for c in caches.values())
                    continue
                c = getattr(obj, "compile_cache", obj)
                if type(c).__name__.endswith("Cache") and isinstance(getattr(c, "cache", None), dict):
                    if id(c) not in seen:
                        seen.add(id(c))
                        out[group] += len(c.cache)
            except Exception:  # an object whose attribute access fails holds no cache of ours
                continue
    return out


def call_tables(ranks) -> list[tuple]:
    """``(q_ranges, k_ranges, types, k)`` of every rank's ``(KernelSlices, k, v)`` calls (what
    :func:`fa4_keys` reads)."""
    return [(sl.q_ranges, sl.k_ranges, sl.types, kk) for calls in ranks for sl, kk, _ in calls]


def fa4_keys(calls, q, dtype) -> set:
    """The FA4 compile keys of these ``(q_ranges, k_ranges, types, k)`` calls (forward and backward)."""
    from magi_ffa_fa4._launch_meta import compile_key, get_launch_meta

    cap = torch.cuda.get_device_capability(q.device)
    keys = set()
    for qr, kr, tm, k in calls:
        meta = get_launch_meta(qr, kr, tm, q.shape[0], k.shape[0], q.device)
        keys.update(compile_key(meta, dtype=dtype, head_dim=q.shape[2], num_heads_q=q.shape[1],
                                num_heads_kv=k.shape[1], arch=cap[0] * 10 + cap[1]))  # fmt: skip
    return keys


# -------------------------------------------------------------------------------------------- steps
def _kernel(backend: str, mask, rows: list[np.ndarray], head_dim: int):
    """The launchers of ``backend``; ``auto``: what the runtime picks for this mask and ranks (``rows``:
    each rank's global query ids)."""
    # the runtime imported here: the cache counter below is read without it (magi_ffa_fa4's tests)
    from magi_attention.simulate import auto_launchers, kernel_launchers

    if backend != "auto":
        return kernel_launchers(backend)
    return auto_launchers(*mask[1:], rows, None, head_dim)[0]


def _calls_cp1(mask, q, k, v):
    from magi_attention.simulate import checked_slices

    _, qr, kr, tm = mask
    t = [torch.tensor(x, dtype=torch.int32) for x in (qr, kr, tm)]
    return [(checked_slices(*t), k, v)], [np.arange(q.shape[0])], 0.0


def _calls_sim(mask, q, k, v, rk, rv, cp: int):
    """Every rank's calls of the runtime's plan (`common.rank_kernel_calls`): q / k / v a rank's shard, the
    received keys leading rows of ``rk`` / ``rv`` (one buffer of every token)."""
    from magi_solver import PlanOptions, dispatch_choice, plan_attention

    _, qr, kr, tm = mask
    total = q.shape[0] * cp
    t0 = time.perf_counter()
    # the runtime's dispatch: chunk size and algorithm chosen for this mask (DispatchConfig() does the same)
    choice, dispatch = dispatch_choice(qr, kr, tm, total, cp)
    chunk = choice.chunk_size
    options = PlanOptions(min_chunk_size=min(512, chunk))
    plan = plan_attention(qr, kr, tm, total, cp, chunk_size=chunk, options=options, dispatch=dispatch)
    plan_s = time.perf_counter() - t0
    ranks = [rank_kernel_calls(rp, plan.overlap_degree, k, v, rk, rv) for rp in plan.ranks]
    rows = [np.asarray(plan.dispatch.position_ids(r)) for r in range(cp)]
    return ranks, rows, plan_s


def _run_rank(kern, q, do, calls) -> None:
    """One rank's forward and backward as the runtime: one call (the merged stage) writes its own results;
    with more, the first call writes, later stages merge into an fp32 accumulator, gradients accumulate."""
    if not calls:
        return
    (sl, kk, vv), rest = calls[0], calls[1:]
    out, lse = kern.fwd_slices(q, kk, vv, sl)
    if not rest:
        kern.bwd_slices(do, q, kk, vv, out, lse, sl)
        return
    out = out.float()
    for sl, kk, vv in rest:
        kern.fwd_slices(q, kk, vv, sl, out=out, lse=lse)
    o = out.to(q.dtype)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    for sl, kk, vv in calls:
        dk = torch.zeros(kk.shape, device=q.device, dtype=torch.float32)
        dv = torch.zeros(vv.shape, device=q.device, dtype=torch.float32)
        kern.bwd_slices(do, q, kk, vv, o, lse, sl, dq=dq, dk=dk, dv=dv)


def run_loop(backend: str, cp: int, args, dev: torch.device) -> dict:
    """Warm-up masks, then ``args.steps`` timed new masks; per step the time, the caches, new FA4 keys."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shard = args.tokens // cp
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do, rk, rv = (torch.randn(n, h, args.head_dim, generator=g).to(dev, dtype) for n, h in (
        (shard, args.heads_q), (shard, args.heads_kv), (shard, args.heads_kv), (shard, args.heads_q),
        (args.tokens, args.heads_kv), (args.tokens, args.heads_kv)))  # fmt: skip
    fa4_seen: set = set()
    profiled: list[str] | None = None  # --profile: each timed step's first run, profiled

    def step(mask) -> dict:
        if cp == 1:
            ranks, rows, plan_s = [_calls_cp1(mask, q, k, v)[0]], [np.arange(shard)], 0.0
        else:
            ranks, rows, plan_s = _calls_sim(mask, q, k, v, rk, rv, cp)
        kern = _kernel(backend, mask, rows, args.head_dim)
        used = {kern.backend.value, kern.backward_backend.value}

        # twice: then the same mask again, its metadata cached, its kernels compiled (the step's work alone)
        def run() -> None:
            for c in ranks:
                _run_rank(kern, q, do, c)

        if profiled is None:
            seconds, rerun = (ms / 1e3 for ms in times_ms(run, 2, device=dev))
        else:  # the first run under torch.profiler: what a slow new mask spends its time on, host and device
            table, seconds = profile_table(lambda: times_ms(run, 1, device=dev)[0] / 1e3, dev.type == "cuda", "cpu_time_total")  # fmt: skip
            rerun = times_ms(run, 1, device=dev)[0] / 1e3
            profiled.append(table)
        new_keys = 0
        if "fa4" in used and dev.type == "cuda":  # after the timing: the launch metadata is cached by now
            keys = fa4_keys(call_tables(ranks), q, dtype)
            new_keys = len(keys - fa4_seen)
            fa4_seen.update(keys)
        return {"kind": mask[0], "slices": len(mask[1]), "backend": "/".join(sorted(used)), "seconds": seconds,
                "rerun_seconds": rerun, "plan_seconds": plan_s, "new_fa4_keys": new_keys, "cache": cache_entries()}  # fmt: skip

    t0 = time.perf_counter()
    warm_masks = [make_mask(i, args.tokens, seed=1000 + cp, kinds=args.kinds) for i in range(args.warmup)]
    if args.warmup_widths is not None:  # FA4's width buckets and varlen window kinds
        from magi_ffa_fa4._launch_meta import warmup_masks

        warm_masks += [(f"warmup{i}", *m) for i, m in enumerate(warmup_masks(args.tokens, args.warmup_widths))]  # fmt: skip
    warm = [step(m) for m in warm_masks]
    warm_s = time.perf_counter() - t0
    cache0 = cache_entries()
    profiled = [] if args.profile else None
    steps = [step(m) for m in loop_masks(args.steps, args.tokens, cp, args.kinds, args.same_area)]
    times = [s["seconds"] for s in steps]
    med = statistics.median(times)
    worst = max(times[1:], default=times[0]) / med if med > 0 else math.inf
    # a stall is a compile: seconds over the same mask's warm re-run (launch metadata costs milliseconds), per
    # rank: this process runs all cp simulated ranks in turn, and each rank of a real run pays only its own
    per_rank = [(s["seconds"] - s["rerun_seconds"]) / cp for s in steps]
    stalls = [i for i in range(1, len(steps)) if per_rank[i] > COMPILE_S]
    new_mask_ms = max(per_rank[1:]) * 1e3 if len(steps) > 1 else 0.0
    if profiled is not None:  # the steps that missed: over 1.5x the median, or a stall
        slow = sorted(set(stalls) | {i for i in range(1, len(steps)) if times[i] > SLOW_RATIO * med})
        with open(args.profile, "a") as f:
            for i in slow:
                f.write(f"== {backend} cp {cp} step {i} ({steps[i]['kind']}): {times[i] * 1e3:.1f} ms, ")
                f.write(f"its re-run {steps[i]['rerun_seconds'] * 1e3:.1f} ms, median {med * 1e3:.1f} ms\n")
                f.write(profiled[i] + "\n\n")
    growth = {n: steps[-1]["cache"][n] - cache0[n] for n in cache0}
    grew_at = [i for i in range(len(steps)) if steps[i]["cache"] != (steps[i - 1]["cache"] if i else cache0)]
    return {"backend": backend, "cp": cp, "tokens": args.tokens, "heads": [args.heads_q, args.heads_kv],
            "head_dim": args.head_dim, "warmup_masks": [m[0] for m in warm_masks], "warmup_seconds": warm_s,
            "warmup_steps": warm, "cache_after_warmup": cache0, "cache_growth": growth, "cache_grew_at_steps": grew_at,
            "new_fa4_key_steps": [i for i, s in enumerate(steps) if s["new_fa4_keys"]], "first_ms": times[0] * 1e3,
            "median_ms": med * 1e3, "worst_over_median": worst, "stall_steps": stalls,
            "new_mask_ms_per_rank": new_mask_ms, "within_timing_target": worst <= SLOW_RATIO,
            "passed": not stalls and not any(growth.values()) and (worst <= SLOW_RATIO or not args.literal),
            "steps": steps}  # fmt: skip


def _available(backend: str) -> str:
    """'' when this process can run ``backend``, else why not."""
    import importlib

    if backend not in ("fa4", "cudnn"):
        return ""
    try:
        ok = getattr(importlib.import_module(f"magi_ffa_{backend}"), f"{backend}_available")()
    except ImportError as e:
        return str(e)
    return "" if ok else {"fa4": "flash-attn-4", "cudnn": "cuDNN flex_attention"}[backend] + " does not import"  # fmt: skip


def add_arguments(p) -> None:
    add_common(p, tokens=16384, heads="32:8", head_dim=128, out_dir=None)
    p.add_argument("--backends", default="fa4,cudnn,triton,auto", help="comma-separated kernel backends")
    p.add_argument("--cps", default="1,8", help="cp sizes (1: one call; >1: simulated ranks)")
    p.add_argument("--steps", type=int, default=20, help="timed steps, one new mask each")
    p.add_argument("--kinds", type=lambda x: tuple(k for k in x.split(",") if k), default=KINDS,
                   help=f"comma-separated mask kinds, in turn (from {','.join(KINDS)})")  # fmt: skip
    p.add_argument("--warmup", type=int, default=len(KINDS), help="warm-up masks (other seeds) before them")
    p.add_argument("--same-area", action="store_true", help="every mask of a kind within 10%% of that kind's "
                   "first mask's area (a training loop's packs)")  # fmt: skip
    p.add_argument("--warmup-widths", type=lambda x: tuple(int(w) for w in x.split(",") if w) if x != "none" else None,
                   default=(1, 2, 4, 8, 16), help="and magi_ffa_fa4's warm-up masks up to these interval counts "
                   "per row ('none': without)")  # fmt: skip
    p.add_argument("--device", default="cuda")
    p.add_argument("--check", action="store_true", help="exit 1 when a run misses a target")
    p.add_argument("--profile", default=None, help="file: profile each timed step's first run (slower) and append "
                   "the tables of the steps that miss")  # fmt: skip
    p.add_argument("--literal", action="store_true", help="the target is every step after the first within 1.5x "
                   "the median (fair on masks of equal work)")  # fmt: skip


def main(args) -> int:
    args.heads_q, args.heads_kv = heads(args.heads)
    dev = torch.device(args.device)
    rows = []
    for backend, cp in itertools.product(args.backends.split(","), map(int, args.cps.split(","))):
        if args.tokens % cp:
            raise SystemExit(f"--tokens {args.tokens} is not a multiple of cp {cp}")
        why = _available(backend)
        if why:
            rows.append({"backend": backend, "cp": cp, "skipped": why})
            print(f"# {backend} cp{cp}: skipped ({why})", flush=True)
            continue
        rows.append(run_loop(backend, cp, args, dev))
        r = rows[-1]
        print(f"# {backend} cp{cp}: warm-up {r['warmup_seconds']:.1f} s, median {r['median_ms']:.2f} ms", flush=True)  # fmt: skip
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__}  # fmt: skip
    write_results(args.out_dir, "mask_loop", {"meta": meta, "rows": rows})
    print(f"\n{meta['device']}, {args.tokens} tokens, {args.heads_q}:{args.heads_kv} heads, d {args.head_dim}")  # fmt: skip
    print("backend   cp  warm-up s  first ms  median ms  worst/med  <=1.5x med  new-mask ms/rank  compiles  "
          "cache growth  new FA4 keys  pass")  # fmt: skip
    for r in rows:
        if "skipped" in r:
            print(f"{r['backend']:<8} {r['cp']:>3}  skipped: {r['skipped'][:50]}")
            continue
        growth = ",".join(f"{n}+{d}" for n, d in r["cache_growth"].items() if d) or "none"
        new = ",".join(map(str, r["new_fa4_key_steps"])) or "-"
        stalls = ",".join(map(str, r["stall_steps"])) or "-"
        print(f"{r['backend']:<8} {r['cp']:>3}  {r['warmup_seconds']:>9.1f}  {r['first_ms']:>8.1f}  "
              f"{r['median_ms']:>9.2f}  {r['worst_over_median']:>9.2f}  {'yes' if r['within_timing_target'] else 'NO':<10}"
              f"  {r['new_mask_ms_per_rank']:>16.1f}  {stalls:<8}  {growth:<12}  {new:<12}  {'yes' if r['passed'] else 'NO'}")  # fmt: skip
    failed = [r for r in rows if not r.get("passed", True)]
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
