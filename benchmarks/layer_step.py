"""An attention-only training step of many layers on one mask: our kernel API, ``calc_attn``, the vendors.
What it measures and how to run it: docs/benchmarks/cases.md (layer-step)."""

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks.cli import add_common, heads, ints, names, run_module, table, write_results
from benchmarks.common import CALC_ATTN_RUNNERS, environment, interleaved, times_ms

DEFAULT_RUNNERS = ("ffa_fa4", "ffa_cudnn", "auto", "calc_fa4", "calc_cudnn", "calc_triton", "fa4", "cudnn_flex")  # fmt: skip
MODES = ("same", "new")
CALC = {**CALC_ATTN_RUNNERS, "calc_torch": "torch"}
"""Runner name -> ``kernel_backend`` of ``calc_attn`` at cp 1."""
KERNEL_API = {"ffa_fa4": "magi_ffa_fa4", "ffa_cudnn": "magi_ffa_cudnn", "ffa": "magi_ffa"}
"""Runner name -> the package whose ``flex_flash_attn_func`` it calls."""
VENDOR_PAIRS = (
    ("ffa_fa4", "fa4"), ("ffa_cudnn", "cudnn_flex"),  # kernel API / vendor
    ("auto", "fa4"), ("auto", "cudnn_flex"), ("calc_fa4", "fa4"), ("calc_cudnn", "cudnn_flex"),  # calc_attn / vendor
)  # fmt: skip
CALC_PAIRS = (("ffa_fa4", "calc_fa4"), ("ffa_cudnn", "calc_cudnn"), ("ffa", "calc_triton"), ("ffa", "calc_torch"))  # fmt: skip
"""Kernel API / the same backend through ``calc_attn`` (``ffa`` is Triton on a GPU, torch on a CPU)."""


@dataclass(frozen=True, slots=True)
class Mask:
    """Packed causal documents over ``total`` tokens: the host lists a data loader hands over."""

    cu_seqlens: tuple[int, ...]
    seed: int

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    def ranges(self) -> list[list[int]]:
        return [[a, b] for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:], strict=True)]

    def slice_mask(self):
        from magi_attention.vendors import SliceMask

        docs = self.ranges()
        return SliceMask.of(docs, docs, [1] * len(docs), self.total, name=f"docs seed {self.seed}")


def docs_mask(total: int, seed: int) -> Mask:
    """Packed causal documents with long-tailed lengths (``magi_solver.long_tailed_cu_seqlens``), seeded."""
    from magi_solver import long_tailed_cu_seqlens

    return Mask(tuple(long_tailed_cu_seqlens(total, seed)), seed)


@dataclass(frozen=True, slots=True)
class Runner:
    """``prepare(mask)``: the runner's per-mask work (its result handed to every layer); ``layer(prepared,
    q, k, v) -> out``: one layer's attention."""

    prepare: Callable[[Mask], object]
    layer: Callable[[object, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _tables(mask: Mask, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mask's range tables on ``device`` as int32 (as FA4 users pass ``cu_seqlens``)."""
    docs = mask.ranges()
    ranges = torch.tensor(docs, dtype=torch.int32, device=device)
    return ranges, ranges, torch.ones(len(docs), dtype=torch.int32, device=device)


def make_runner(name: str, sample: Sequence[torch.Tensor]) -> Runner:
    """Runner ``name`` (see the module docstring); ``sample``: one layer's (q, k, v), for the shapes (cuDNN's
    plan, the key). Raises when this machine cannot run it (a vendor or backend missing)."""
    import importlib

    from magi_attention import vendors

    q0, k0, _ = sample
    device = q0.device
    if name in KERNEL_API:
        mod = importlib.import_module(KERNEL_API[name])
        return Runner(lambda m: _tables(m, device), lambda t, q, k, v: mod.flex_flash_attn_func(q, k, v, *t)[0])  # fmt: skip
    if name in CALC:
        from magi_attention import DistAttnConfig, calc_attn, magi_attn_flex_key

        total, hq, d = q0.shape
        config = DistAttnConfig(kernel_backend=CALC[name])

        def key(m: Mask):
            docs = m.ranges()
            return magi_attn_flex_key(docs, docs, [1] * len(docs), total, total, hq, k0.shape[1], d, None, config)  # fmt: skip

        key(docs_mask(total, 0))  # a backend this machine cannot run fails here, before any timing
        return Runner(key, lambda key, q, k, v: calc_attn(q, k, v, key)[0])
    if name == "fa4":
        fa = vendors.import_vendor("flash_attn.cute", "flash_attn.cute (FlashAttention-4)")
        return Runner(lambda m: vendors.fa4_local(m.slice_mask(), device, fa)[0], lambda attn, q, k, v: attn(q, k, v))  # fmt: skip
    if name == "cudnn_flex":
        vendors.import_vendor("cudnn.flex_attention", "cudnn.flex_attention (nvidia-cudnn-frontend)")
        return Runner(lambda m: vendors.cudnn_mask_plan(m.slice_mask(), *sample),
                      lambda plan, q, k, v: vendors.cudnn_flex_attn(q, k, v, plan))  # fmt: skip
    raise ValueError(f"unknown runner {name!r}; choose from {sorted({*KERNEL_API, *CALC, 'fa4', 'cudnn_flex'})}")  # fmt: skip


def run_step(runner: Runner, mask: Mask, layers: Sequence[Sequence[torch.Tensor]], do: torch.Tensor,
             prepared: object = None) -> None:  # fmt: skip
    """One step: the per-mask work (unless ``prepared`` is given), every layer's forward on fresh leaves of
    its q / k / v, then one backward through all layers (``do`` the gradient of every layer's output)."""
    prep = runner.prepare(mask) if prepared is None else prepared
    outs = []
    for qkv in layers:
        q, k, v = (x.detach().requires_grad_() for x in qkv)  # new tensors each layer and step
        outs.append(runner.layer(prep, q, k, v))
    torch.autograd.backward(outs, [do] * len(outs))


def layer_step(names: Sequence[str], total: int, *, heads: tuple[int, int] = (64, 8), head_dim: int = 128,
               layers: int = 32, steps: int = 8, warmup: int = 2, modes: Sequence[str] = MODES,
               device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> list[dict]:  # fmt: skip
    """Rows ``{runner, mode, tokens, ...}`` with ``median_ms``, ``spread_ms`` and the steps' ``times_ms``, or
    ``error`` for a runner that cannot run here (see the module docstring)."""
    from magi_attention import clear_cache

    known = {*KERNEL_API, *CALC, "fa4", "cudnn_flex"}
    if unknown := [n for n in names if n not in known]:
        raise ValueError(f"unknown runners {unknown}; choose from {sorted(known)}")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"modes must be among {MODES}, got {mode!r}")
    dev = torch.device(device)
    hq, hk = heads
    gen = torch.Generator(device=dev).manual_seed(0)
    qkvs = [tuple(torch.randn(total, h, head_dim, device=dev, dtype=dtype, generator=gen) for h in (hq, hk, hk))
            for _ in range(layers)]  # fmt: skip
    do = torch.randn(total, hq, head_dim, device=dev, dtype=dtype, generator=gen)
    base = dict(tokens=total, heads=f"{hq}:{hk}", d=head_dim, layers=layers, dtype=str(dtype).removeprefix("torch."))  # fmt: skip
    runners, rows = {}, []
    for name in names:
        try:
            runners[name] = make_runner(name, qkvs[0])
        except Exception as e:  # not installed or not runnable here: reported, not hidden
            rows += [dict(runner=name, mode=mode, **base, error=repr(e)[:300]) for mode in modes]
            print(f"# {name} unavailable: {e!r}"[:200], flush=True)
    for mode in modes:
        masks = [docs_mask(total, 0)] * (warmup + steps) if mode == "same" else [
            docs_mask(total, 1 + i) for i in range(warmup + steps)
        ]  # fmt: skip
        prepared, errors = {}, {}
        if mode == "same":  # the per-mask work once, outside the timing
            for name, r in runners.items():
                try:
                    prepared[name] = r.prepare(masks[0])
                except Exception as e:
                    errors[name] = repr(e)[:300]
        # one step per mask, the runners interleaved; a runner that fails is reported, the others go on
        times = interleaved(list(runners), len(masks), lambda name, i, ms=masks, p=prepared: times_ms(
            lambda: run_step(runners[name], ms[i], qkvs, do, p.get(name)), 1, device=dev)[0], errors)  # fmt: skip
        for name in runners:
            row = dict(runner=name, mode=mode, **base)
            if name in errors:
                row["error"] = errors[name]
            else:
                t = times[name][warmup:]
                row.update(median_ms=round(statistics.median(t), 3), spread_ms=round(max(t) - min(t), 3),
                           steps=len(t), times_ms=[round(x, 3) for x in t])  # fmt: skip
            rows.append(row)
        prepared.clear()
        clear_cache()  # this mode's plans (cp 1)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return sorted(rows, key=lambda r: (MODES.index(r["mode"]), list(names).index(r["runner"])))


def _ratio(by: dict[str, dict], ours: str, vendor: str) -> str | None:
    a, b = by.get(ours), by.get(vendor)
    if not a or not b or "error" in a or "error" in b:
        return None
    return f"{b['median_ms'] / a['median_ms']:.2f}"


def render(rows: list[dict]) -> list[str]:
    """Markdown: per (tokens, mode) each runner's median and spread (ms), then the ratios (speed: the other
    runner's median over ours)."""
    lines = []
    cases = sorted({(r["tokens"], r["mode"]) for r in rows}, key=lambda c: (c[0], MODES.index(c[1])))
    for tokens, mode in cases:
        by = {r["runner"]: r for r in rows if r["tokens"] == tokens and r["mode"] == mode}
        some = next(iter(by.values()))
        what = "same mask every step" if mode == "same" else "a new mask every step (per-mask work timed)"
        size = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
        lines += ["", f"{some['layers']} layers, {size} tokens, {some['heads']}, d {some['d']}, {some['dtype']}: {what}",
                  "", *table(["runner", "median ms", "spread ms"], [[name, *(["unavailable", "-"] if "error" in r else
                  [f"{r['median_ms']:.1f}", f"{r['spread_ms']:.1f}"])] for name, r in by.items()])]  # fmt: skip
        ratios = [(kind, f"{a} / {b}", x) for kind, pairs in (("vs vendor", VENDOR_PAIRS), ("kernel API / calc_attn",
                  CALC_PAIRS)) for a, b in pairs if (x := _ratio(by, a, b)) is not None]  # fmt: skip
        if ratios:
            lines += ["", *table(["ratio (speed)", "runners", "x"], ratios)]
    return lines


def add_arguments(ap) -> None:
    add_common(ap, seqlens="8192,32768", heads="64:8", head_dim=128, out_dir=None, tag="layer_step")
    ap.add_argument("--runners", default=",".join(DEFAULT_RUNNERS), help="comma-separated runners")
    ap.add_argument("--layers", type=int, default=32, help="layers per step")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per runner (median)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first")
    ap.add_argument("--modes", default="same,new", help="same mask every step, a new one")
    ap.add_argument("--device", default="cuda", help="cpu: the torch path at toy sizes (fp32)")


def main(args) -> None:
    """The rows of every ``--seqlens`` size, written as ``<tag>.json`` and ``<tag>.md``."""
    rows = []
    for total in ints(args.seqlens):
        rows += layer_step(names(args.runners), total, heads=heads(args.heads), head_dim=args.head_dim,
                           layers=args.layers, steps=args.steps, warmup=args.warmup_steps, modes=names(args.modes),
                           device=args.device, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32)  # fmt: skip
    env = environment()
    text = "\n".join([
        f"Measured {env['date']} on {env['gpu']}, torch {env['torch']}, commit {env['git']}, {env['versions']}; "
        "`python -m benchmarks layer-step`, runners interleaved, median and spread (max - min) of the timed "
        "steps; ratios: speed, the second runner's median over the first's.",
        *render(rows),
    ]) + "\n"  # fmt: skip
    write_results(args.out_dir, args.tag, dict(env=env, rows=rows), text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
