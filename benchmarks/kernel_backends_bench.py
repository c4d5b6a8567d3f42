"""The kernel backends side by side on the same inputs, interleaved over ``--repeats`` rounds.
What it measures and how to run it: docs/benchmarks/cases.md (kernels)."""

import json
import statistics
from pathlib import Path

import torch

from benchmarks.cli import add_common, heads, ints, names, run_module, table, write_results
from benchmarks.common import (
    build_mask,
    calc_attn_runner,
    environment,
    flex_setup,
    interleaved,
    kernel_runners,
    profile_table,
    time_fwd_bwd,
)
from magi_attention.simulate import kernel_launchers

DEFAULT_KERNELS = (
    "auto,calc_cudnn,calc_fa4,calc_triton,ffa_cudnn,cudnn_flex,cudnn_varlen,ffa_fa4,fa4,flex,ffa"
)
PAIRS = (
    ("ffa_cudnn", "cudnn_flex"), ("ffa_fa4", "fa4"), ("ffa_cudnn", "ffa_fa4"),
    ("ffa_fa4", "calc_fa4"), ("ffa_cudnn", "calc_cudnn"), ("ffa", "calc_triton"),
)  # fmt: skip
"""The ratio columns (fwd / bwd TFLOP/s of the first over the second): each backend's kernel API against the
vendor's own call, cuDNN's against FA4's, and each kernel API against the same backend through ``calc_attn``
at cp = 1 (what the per-call work costs beyond the kernels)."""
DET_BACKENDS = ("fa4", "cudnn", "triton")
DET_KERNELS = ",".join([*(f"launch_{b}{m}" for b in DET_BACKENDS for m in ("", "_det")), "auto", "auto_det"])
"""``--deterministic``'s runners: each backend's launchers both ways, and ``calc_attn``'s ``auto`` both ways."""


class _LauncherAttn(torch.autograd.Function):
    """One backend's launchers as an autograd function, with ``deterministic`` passed to both directions
    (the forward is deterministic anyway; the backward is what the flag changes)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, ranges, det: bool):
        res = kernel.fwd(q, k, v, *ranges, deterministic=det)
        out, lse = res[0], res[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.ranges, ctx.det = kernel, ranges, det
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        res = ctx.kernel.bwd(do.contiguous(), q, k, v, out, lse, *ctx.ranges, deterministic=ctx.det)
        return res[0], res[1], res[2], None, None, None


def _det_runners(m, S: int, hq: int, hk: int, d: int, kernels: set[str]) -> dict:
    """``--deterministic``'s runners (see the module docstring): name -> (fn, inputs needing grad)."""
    import os
    from unittest import mock

    q, k, v = (torch.randn(S, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (hq, hk, hk))  # fmt: skip
    ranges = (m.q_ranges, m.k_ranges, m.attn_type_map)
    out = {}
    for b in DET_BACKENDS:
        for det in (False, True):
            name = f"launch_{b}{'_det' if det else ''}"
            if name not in kernels:
                continue
            try:
                kernel = kernel_launchers(b)
            except Exception as e:  # not installed here: reported, not hidden
                print(f"# {name} unavailable: {e!r}"[:200])
                continue
            out[name] = (lambda kernel=kernel, det=det: _LauncherAttn.apply(q, k, v, kernel, ranges, det), (q, k, v))  # fmt: skip
    for name, det in (("auto", False), ("auto_det", True)):
        if name not in kernels:
            continue
        # the mode is read when the config is built
        with mock.patch.dict(os.environ, {"MAGI_ATTENTION_DETERMINISTIC_MODE": "1" if det else "0"}):
            try:
                out[name] = calc_attn_runner(m, q, k, v, "auto")
            except Exception as e:
                print(f"# {name} unavailable: {e!r}"[:200])
    return out


def _time_rank_calls(lq, ldo, calls, kern, det: bool, args) -> tuple[float, float]:
    """Median fwd and bwd ms over ``args.repeats`` rounds of one rank's kernel calls (the runtime's order:
    the host call, then the remote one, merged into fp32 accumulators)."""
    from triton.testing import do_bench

    def fwd():
        out = torch.zeros(lq.shape, dtype=torch.float32, device="cuda")
        lse = torch.full(lq.shape[:2], float("-inf"), dtype=torch.float32, device="cuda")
        for sl, kk, vv in calls:
            kern.fwd_slices(lq, kk, vv, sl, out=out, lse=lse, deterministic=det)
        return out.to(lq.dtype), lse

    o16, lse = fwd()

    def bwd():
        dq = torch.zeros(lq.shape, dtype=torch.float32, device="cuda")
        for sl, kk, vv in calls:
            dk = torch.zeros(kk.shape, dtype=torch.float32, device="cuda")
            dv = torch.zeros(vv.shape, dtype=torch.float32, device="cuda")
            kern.bwd_slices(ldo, lq, kk, vv, o16, lse, sl, dq=dq, dk=dk, dv=dv, deterministic=det)

    fw, bw = [], []
    for _ in range(args.repeats):
        fw.append(do_bench(fwd, warmup=args.warmup, rep=args.rep, return_mode="median"))
        bw.append(do_bench(bwd, warmup=args.warmup, rep=args.rep, return_mode="median"))
    return round(statistics.median(fw), 4), round(statistics.median(bw), 4)


def _planned(mask: str, cp: int, tokens_per_gpu: int, chunk: int | None = None):
    """``(total, plan, features)``: the runtime's plan of a ``magi_attention_bench.py`` mask (overlap degree 0)
    and its busiest rank's features as the runtime computes them at that cp (its keys, then the remote keys)."""
    import numpy as np

    from benchmarks.magi_attention_bench import make_mask, make_plan
    from magi_solver.kernel_choice import busiest_rank_features, kernel_key_ids

    total, plan = make_plan(mask, cp, tokens_per_gpu, 0, chunk)
    ids = [np.asarray(plan.dispatch.position_ids(r)) for r in range(plan.cp_size)]
    keys = kernel_key_ids(ids, plan.kv_layout)
    return total, plan, busiest_rank_features(*make_mask(mask, total), ids, rank_keys=keys)


def _by_case(rows: list[dict], order) -> list[tuple[tuple, dict]]:
    """The rows grouped by case ``(S, hq, hk, d, mask)``, sorted by ``order(case)``: ``[(case, {kernel: row})]``."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r["S"], r["hq"], r["hk"], r["d"], r["mask"]), {})[r["kernel"]] = r
    return sorted(groups.items(), key=lambda item: order(item[0]))


def sim_det_rows(args) -> list[dict]:
    """The busiest rank of a simulated cp ``--sim-cp`` plan (overlap degree 0: its host call and one remote
    call), timed per backend with ``deterministic`` False and True (``launch_<backend>[_det]`` rows, mask
    ``"<mask> cp <cp>"``, S = tokens per GPU), with the rank's features as the runtime computes them."""
    from magi_attention.simulate import checked_slices, rank_calls, token_index

    cp = args.sim_cp
    hq, hk = heads(names(args.heads)[0])
    d = ints(args.head_dims)[0]
    rows = []
    for mask in names(args.sim_masks):
        for tpg in ints(args.sim_tokens_per_gpu):
            total, plan, f = _planned(mask, cp, tpg)

            def area(rp) -> int:
                return rp.host_slices.area() + sum(st.remote_slices.area() for st in rp.stages)

            rank_plan = max(plan.ranks, key=lambda rp: (area(rp), -rp.rank))  # the runtime's busiest rank
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for h in (hq, hk, hk))  # fmt: skip
            kv = plan.kv_layout
            rc = rank_calls(rank_plan, k, v, None if kv is None else kv.host_token_ranges(rank_plan.rank),
                            merged=plan.overlap_degree == 0)  # fmt: skip
            q_index = token_index(rank_plan.host_token_ranges, q.device)
            lq = q[q_index].contiguous()
            ldo = torch.randn_like(lq)
            calls = [(checked_slices(*t), kk, vv) for t, kk, vv in rc.calls if t[0].shape[0]]
            for b in DET_BACKENDS:
                try:
                    kern = kernel_launchers(b)
                except Exception as e:
                    print(f"# sim {b} unavailable: {e!r}"[:200])
                    continue
                for det in (False, True):
                    name = f"launch_{b}{'_det' if det else ''}"
                    r = dict(kernel=name, mask=f"{mask} cp {cp}", S=tpg, hq=hq, hk=hk, d=d, area=f.area,
                             features=f.to_dict())  # fmt: skip
                    try:
                        fwd_ms, bwd_ms = _time_rank_calls(lq, ldo, calls, kern, det, args)
                        r.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, repeats=args.repeats)
                    except Exception as e:  # e.g. FA4 refusing a deterministic block-sparse backward
                        r["error"] = repr(e)[:300]
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            del q, k, v, rc, lq, ldo, calls
            torch.cuda.empty_cache()
    return rows


def render_det(rows: list[dict]) -> list[str]:
    """Deterministic / default per backend and direction (ms ratios; the forward should stay at ~1)."""
    pairs = [(f"launch_{b}", f"launch_{b}_det", b) for b in DET_BACKENDS] + [("auto", "auto_det", "auto")]
    lines = ["", "Deterministic mode against the default, per backend: bwd ms default -> deterministic (ratio); "
             "fwd ratio.", ""]  # fmt: skip
    body = []
    for (S, hq, hk, d, mask), by in _by_case(rows, lambda x: (x[3], x[4], x[0])):

        def cell(a, b, by=by):
            ra, rb = by.get(a), by.get(b)
            if ra is None or rb is None:
                return "-"
            if "error" in ra:
                return "err"
            if "error" in rb:
                return f"{ra['bwd_ms']:.2f} -> refused"
            return (f"{ra['bwd_ms']:.2f} -> {rb['bwd_ms']:.2f} ({rb['bwd_ms'] / ra['bwd_ms']:.2f}x); "
                    f"fwd {rb['fwd_ms'] / ra['fwd_ms']:.2f}x")  # fmt: skip

        size = f"{S // 1024}k" + ("/GPU" if " cp " in mask else "")
        body.append([size, f"{hq}:{hk}", d, mask, *(cell(a, b) for a, b, _ in pairs)])
    lines += table(["S", "heads", "d", "mask", *(label for *_, label in pairs)], body)
    return lines


def _profile_runners(runners: dict, grads: dict, case: str) -> str:
    """Each runner's forward + backward, 5 calls (after its timing) under torch.profiler: its top ops by GPU time
    beside their host time, so a gap between two runners shows whether it is the GPU's work or the host's."""
    steps = {n: (lambda fn=fn, xs=xs, g=grads[n]: torch.autograd.grad(fn(), xs, g)) for n, (fn, xs) in runners.items() if n in grads}  # fmt: skip
    tables = {n: profile_table(lambda s=s: [s() for _ in range(5)], True, "self_cuda_time_total", 100)[0] for n, s in steps.items()}  # fmt: skip
    return "\n".join([f"## {case}", *(f"### {n} (5 calls)\n{t}" for n, t in tables.items())]) + "\n"


def bench(args) -> list[dict]:
    kernels = set((args.kernels or (DET_KERNELS if args.deterministic else DEFAULT_KERNELS)).split(","))
    flex_tools = flex_setup() if "flex" in kernels else None
    rows = []
    for d in ints(args.head_dims):
        for S in ints(args.seqlens):
            for hq, hk in map(heads, names(args.heads)):
                for name in names(args.masks):
                    m = build_mask(name, S)
                    flops = 4 * m.area * hq * d
                    if args.deterministic:
                        runners = _det_runners(m, S, hq, hk, d, kernels)
                    else:
                        runners = kernel_runners(m, S, hq, hk, d, kernels, flex_tools)
                    grads, errors = {}, {}
                    for kname, (fn, _xs) in runners.items():
                        try:
                            grads[kname] = torch.randn_like(fn())
                        except Exception as e:  # a kernel that cannot run a shape is reported, not hidden
                            errors[kname] = repr(e)[:300]
                    times = interleaved(list(runners), args.repeats, lambda k, _, rn=runners, g=grads: time_fwd_bwd(
                        *rn[k], g[k], args.warmup, args.rep), errors)  # fmt: skip
                    for kname in runners:
                        r = dict(kernel=kname, mask=name, S=S, hq=hq, hk=hk, d=d, area=m.area)
                        if kname in errors:
                            r["error"] = errors[kname]
                        else:
                            fw, bw = (list(t) for t in zip(*times[kname]))
                            mf, mb = statistics.median(fw), statistics.median(bw)
                            r.update(fwd_ms=round(mf, 4), bwd_ms=round(mb, 4), repeats=len(fw),
                                     fwd_tflops=round(flops / mf / 1e9, 1), bwd_tflops=round(2.5 * flops / mb / 1e9, 1),
                                     fwd_spread=round((max(fw) - min(fw)) / mf, 3), bwd_spread=round((max(bw) - min(bw)) / mb, 3))  # fmt: skip
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                    if args.profile:
                        with open(args.profile, "a") as f:
                            ok = {n: r for n, r in runners.items() if n not in errors}
                            f.write(_profile_runners(ok, grads, f"{name} S={S} {hq}:{hk} d={d}"))
                    runners.clear()
                    torch.cuda.empty_cache()
    return rows


def render(data: dict) -> str:
    env, rows = data["env"], data.get("rows", [])
    lines = [f"Measured {env['date']} on {env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['git']}"
             f"{', ' + env['versions'] if env.get('versions') else ''}; `benchmarks/kernel_backends_bench.py`, one "
             "process, kernels interleaved, median of the rounds (spread = (max - min) / median). Cells: fwd / bwd "
             "TFLOP/s.", ""]  # fmt: skip
    if any(r["kernel"].endswith("_det") for r in rows):  # a --deterministic run: ms and ratios, no TFLOP/s
        lines[0] = lines[0].replace(" Cells: fwd / bwd TFLOP/s.", "")
        return "\n".join(lines[:1] + render_det(rows)) + "\n"
    if rows:
        kern = [k for k in DEFAULT_KERNELS.split(",") if any(r["kernel"] == k for r in rows)]
        body = []
        for (S, hq, hk, d, mask), by in _by_case(rows, lambda x: (x[3], x[0], x[4])):

            def cell(k, by=by):
                r = by.get(k)
                if r is None:
                    return "-"
                return "err" if "error" in r else f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f}"

            def ratio(a, b, by=by):
                ra, rb = by.get(a), by.get(b)
                if not ra or not rb or "error" in ra or "error" in rb:
                    return "-"
                return (
                    f"{ra['fwd_tflops'] / rb['fwd_tflops']:.2f} / {ra['bwd_tflops'] / rb['bwd_tflops']:.2f}"
                )

            calc = [by[k] for k in kern if k.startswith("calc_") and "error" not in by[k]]
            auto = by.get("auto")
            versus = "-"
            if calc and auto and "error" not in auto:
                versus = " / ".join(f"{auto[f] / max(r[f] for r in calc):.2f}" for f in ("fwd_tflops", "bwd_tflops"))  # fmt: skip
            spread = max((max(r["fwd_spread"], r["bwd_spread"]) for r in by.values() if "error" not in r), default=0)  # fmt: skip
            body.append([f"{S // 1024}k", f"{hq}:{hk}", d, mask, *map(cell, kern),
                         *(ratio(a, b) for a, b in PAIRS), versus, f"{spread:.0%}"])  # fmt: skip
        lines += table(["S", "heads", "d", "mask", *kern, *(f"{a} / {b}" for a, b in PAIRS),
                        "auto / fastest calc_*", "max spread"], body)  # fmt: skip
    return "\n".join(lines) + "\n"


RUNTIME_NAMES = {"ffa_fa4": "fa4", "ffa_cudnn": "cudnn", "ffa": "triton"}
DET_NAMES = {f"launch_{b}_det": b for b in DET_BACKENDS}
"""``--deterministic`` runs' rows that become the table's deterministic rows (the default-mode ``launch_*``
rows of such a run stay out: the table's default rows come from the backends' own entry points)."""


def _features_at_cp1(mask: str, S: int):
    """The features the runtime computes for this mask at cp = 1 (every row on one rank, keys in order)."""
    import numpy as np

    from magi_solver.kernel_choice import busiest_rank_features

    m = build_mask(mask, S, device="cpu")
    return busiest_rank_features(m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(),
                                 [np.arange(S)])  # fmt: skip


def _table_row(key: tuple, f: dict, ms: dict, source: str, det: bool = False) -> dict:
    """A row of the auto table: the case ``key`` (S, d, hq, hk, mask), its features (``MaskFeatures.to_dict()``),
    the ms per backend, where they were measured."""
    S, d, hq, hk, mask = key
    return {"mask": mask, "tokens": S, "head_dim": d, "heads": f"{hq}:{hk}", "tile_fill": round(f["tile_fill"], 4),
            "slices_per_row": round(f["slices_per_row"], 4), "documents": f["documents"], "ms": ms, "source": source,
            **({"deterministic": True} if det else {})}  # fmt: skip


def _sim_rows(sim_sources: str) -> dict[tuple, dict]:
    """Table rows of the busiest rank of simulated cp runs (``sim --degree 0`` JSON, ``backend=path,...``):
    its ms per backend, its features as the runtime computes them at that cp (one backend alone: left out)."""
    import re

    found: dict[tuple, dict] = {}
    for spec in filter(None, sim_sources.split(",")):
        backend, _, path = spec.partition("=")
        data = json.loads(Path(path).read_text())
        hq, hk, d = (int(x) for x in re.search(r"heads (\d+):(\d+), d (\d+)", data["header"]).groups())
        for entry in data["sim"]:
            if entry["degree"] != 0:  # one kernel call per direction, like every other row
                continue
            if entry.get("kernel_backend", backend) != backend:  # another backend's rows of the same run
                continue
            key = (entry["tokens_per_gpu"], d, hq, hk, f"{entry['mask']} cp {entry['cp']}")
            busiest = max(entry["ranks"], key=lambda r: (r["area"], -r["rank"]))
            row = found.setdefault(key, {"entry": entry, "ms": {}, "source": []})
            row["ms"][backend] = [round(busiest["fwd_ms"], 4), round(busiest["bwd_ms"], 4)]
            row["source"].append(Path(path).name)
    rows = {}
    for key, row in found.items():
        S, d, hq, hk, name = key
        if len(row["ms"]) < 2:  # a row with one backend measured would pick it whatever the others do
            continue
        entry = row["entry"]
        # the plan that run measured: its recorded chunk, else the fixed chunk magi_attention_bench used
        # before it planned with the runtime's choice (min(2048, tokens per GPU / 4))
        chunk = entry.get("chunk_size", min(2048, S // 4))
        _, _, f = _planned(entry["mask"], entry["cp"], S, chunk)
        busiest = max(entry["ranks"], key=lambda r: (r["area"], -r["rank"]))
        if f.area != busiest["area"]:
            raise ValueError(f"{name}: the planned busiest rank's area {f.area} is not the measured {busiest['area']}")  # fmt: skip
        rows[key] = _table_row(key, f.to_dict(), row["ms"], "+".join(row["source"]))
    return rows


def write_table(out: str, sources: str, sim_sources: str = "", base: str = "") -> dict:
    """The auto table from measured rows (see the module docstring); ``base``: an existing table whose rows
    are kept unless a source measured the same (size, head_dim, heads, mask, mode)."""
    from magi_solver import gpu_kind

    rows: dict[tuple, dict] = {}
    env = None
    base_table = json.loads(Path(base).read_text()) if base else None
    if base_table is not None:
        for r in base_table["rows"]:
            hq, hk = (int(x) for x in r["heads"].split(":"))
            rows[(r["tokens"], r["head_dim"], hq, hk, r["mask"], bool(r.get("deterministic", False)))] = r
    for spec in filter(None, sources.split(",")):
        path, _, masks = spec.partition(":")
        keep = set(masks.split("+")) if masks else None
        data = json.loads(Path(path).read_text())
        env = env or data["env"]
        found: dict[tuple, dict] = {}
        features: dict[tuple, dict] = {}
        for r in data["rows"]:
            det = r["kernel"] in DET_NAMES
            name = DET_NAMES.get(r["kernel"]) or RUNTIME_NAMES.get(r["kernel"])
            if name is None or "error" in r or (keep is not None and r["mask"] not in keep):
                continue
            key = (r["S"], r["d"], r["hq"], r["hk"], r["mask"], det)
            found.setdefault(key, {})[name] = [r["fwd_ms"], r["bwd_ms"]]
            if "features" in r:  # a simulated rank's, as the runtime computes them at that cp
                features[key] = r["features"]
        for key, ms in found.items():
            S, *_, mask, det = key
            f = features.get(key) or _features_at_cp1(mask, S).to_dict()
            rows[key] = _table_row(key[:5], f, ms, Path(path).name, det)
    rows.update({(*k, False): v for k, v in _sim_rows(sim_sources).items()})
    if env is None and base_table is None:
        raise SystemExit("--write-table needs --sources or --base")
    source = base_table["source"] if base_table is not None else ""
    if env is not None:
        measured = (f"benchmarks/kernel_backends_bench.py, {env['date']}, {env['gpu']}, torch {env['torch']}, "
                    f"{env.get('versions', '')}")  # fmt: skip
        source = measured if not source else f"{source}; {measured}"
    table = {"gpu_kind": gpu_kind(env["gpu"]) if env is not None else base_table["gpu_kind"], "source": source,
             "rows": [rows[k] for k in sorted(rows, key=lambda k: (*k[:5], k[5]))]}  # fmt: skip
    Path(out).write_text(json.dumps(table, indent=1) + "\n")
    return table


def add_arguments(ap) -> None:
    add_common(ap, masks="full,varlen_causal,swa_causal_w1024,varlen_block_causal,random", seqlens="8192,32768",
               heads="64:8", repeats=5, out_dir=None, tag="kernel_backends")  # fmt: skip
    ap.add_argument("--head-dims", default="128", help="comma-separated head dimensions")
    ap.add_argument("--kernels", default="", help=f"default: {DEFAULT_KERNELS} (--deterministic: {DET_KERNELS})")  # fmt: skip
    ap.add_argument("--deterministic", action="store_true", help="time each runtime backend's backward in "
                    "deterministic mode against its default")  # fmt: skip
    ap.add_argument("--sim-cp", type=int, default=0, help="--deterministic: also the busiest rank at this cp")
    ap.add_argument("--sim-masks", default="varlen_causal,full", help="`sim` case masks for --sim-cp")
    ap.add_argument("--sim-tokens-per-gpu", default="8192")
    ap.add_argument("--warmup", type=int, default=5, help="do_bench warm-up (ms)")
    ap.add_argument("--rep", type=int, default=25, help="do_bench measurement window per round (ms)")
    ap.add_argument("--profile", metavar="PATH", help="append each runner's torch.profiler table to PATH")
    ap.add_argument("--write-table", metavar="OUT", help="write the auto table from --sources and exit")
    ap.add_argument("--sources", default="", help="measured JSON files for --write-table (path[:mask+mask],...)")  # fmt: skip
    ap.add_argument("--sim-sources", default="", help="for --write-table: simulated cp runs, backend=path,... "
                    "(`sim` case JSON at --degree 0)")  # fmt: skip
    ap.add_argument("--base", default="", help="for --write-table: an existing table to add rows to")  # fmt: skip


def main(args) -> None:
    if args.write_table:
        table = write_table(args.write_table, args.sources, args.sim_sources, args.base)
        print(f"{len(table['rows'])} rows for {table['gpu_kind']} -> {args.write_table}")
        return
    data = dict(env=environment(), rows=bench(args))
    if args.deterministic and args.sim_cp:
        data["rows"] += sim_det_rows(args)
    text = render(data)
    write_results(args.out_dir, args.tag, data, text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
