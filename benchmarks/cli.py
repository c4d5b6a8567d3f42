"""The one benchmark runner: ``python -m benchmarks [<case> [args | --help]]`` (no case: the list). A case
is a module with ``add_arguments(parser)`` (shared options: `add_common`) and ``main(args) -> int | None``;
result files go under ``--out-dir`` (default `RESULTS`), never the current directory; under ``torchrun`` the
same command line runs on every rank (``torchrun --standalone --nproc-per-node 2 -m benchmarks cp ...``)."""

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
"""Where result files go unless ``--out-dir`` says otherwise."""


@dataclass(frozen=True)
class Case:
    """One registered benchmark: its command name, the module that runs it and what it measures.
    ``own_parser``: the module parses its own command line (``main(argv)``) instead of ``add_arguments``."""

    name: str
    module: str
    measures: str
    own_parser: bool = False


CASES = (
    Case("kernels", "kernel_backends_bench", "the kernel backends side by side on one GPU (TFLOP/s; "
         "--deterministic: deterministic backward against the default; --write-table: the auto table)"),
    Case("layer-step", "layer_step", "a 32-layer attention-only step: kernel API and calc_attn beside the vendors' calls"),
    Case("fa4-versions", "fa4_versions", "the table of two flash-attn-4 releases' kernel runs"),
    Case("sim", "magi_attention_bench", "simulated context parallelism on one GPU: every rank's kernels, the "
         "slowest rank, the scaling table, cp = 1 overhead; --plan-only: balance and communication"),
    Case("cp", "cp_bench", "context parallelism over real ranks (torchrun): magi against the baselines"),
    Case("grpcoll", "group_collective_bench", "GroupCast / GroupReduce cost and bandwidth (torchrun or gloo)"),
    Case("checks-overhead", "failure_checks_overhead", "the cost of the always-on failure checks"),
    Case("calibrate", "calibrate_overlap", "the overlap cost model's profile per kernel backend (torchrun)"),
    Case("fit-law", "fit_kernel_law", "the kernel law refitted from scaling runs (no GPU)"),
    Case("mask-loop", "mask_loop_bench", "a training loop's new mask every step: step times and compiles"),
    Case("first-step", "first_step", "the first step of a fresh process against the steady step, cold and warm"),
    Case("plan-targets", "plan_targets", "the planner's targets: balance, communication and bounds (no GPU)",
         own_parser=True),
    Case("key-step", "key_step_bench", "the host cost of a new key + dispatch per step (gloo ranks)",
         own_parser=True),
    *(Case(name, f"integration_runs.{module}", f"{what}: magi against the model's own attention, world 1",
           own_parser=True)
      for name, module, what in (("hf", "hf_run", "Hugging Face models"),
                                 ("hf-deterministic", "hf_deterministic_run", "a Hugging Face model, deterministic"),
                                 ("fsdp", "fsdp_run", "FSDP"), ("megatron", "megatron_run", "Megatron-Core"),
                                 ("torchtitan", "torchtitan_run", "torchtitan"))),
)  # fmt: skip
"""The registry: one entry per case (``python -m benchmarks`` lists it)."""

COMMON = {
    "masks": dict(help="comma-separated mask names"), "seqlens": dict(help="comma-separated total token counts"),
    "tokens": dict(type=int, help="total tokens"), "head_dim": dict(type=int, help="head dimension"),
    "heads": dict(help="heads_q:heads_kv (comma-separated where a case runs several)"),
    "dtype": dict(help="fp64, fp32, bf16 or fp16"), "tag": dict(help="result file name stem"),
    "repeats": dict(type=int, help="interleaved rounds (each cell: the median over them)"),
    "out_dir": dict(help="folder of the result files (default benchmarks/results)"),
}  # fmt: skip
"""The options several cases share: one spelling, one meaning."""


def add_common(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """Add the shared options named in ``defaults`` (keys of `COMMON`) with those defaults; ``out_dir``
    defaults to `RESULTS` when given as None."""
    for name, default in defaults.items():
        if name not in COMMON:
            raise TypeError(f"add_common: unknown option {name!r}; choose from {sorted(COMMON)}")
        if name == "out_dir" and default is None:
            default = str(RESULTS)
        parser.add_argument("--" + name.replace("_", "-"), default=default, **COMMON[name])


def ints(text: str) -> list[int]:
    """``"8192,32768"`` -> ``[8192, 32768]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def names(text: str) -> list[str]:
    """``"a, b,"`` -> ``["a", "b"]``."""
    return [x.strip() for x in text.split(",") if x.strip()]


def heads(text: str) -> tuple[int, int]:
    """``"64:8"`` -> ``(64, 8)``."""
    hq, hk = (int(x) for x in text.split(":"))
    return hq, hk


def usage_error(message: str) -> None:
    """Stop on a bad argument as argparse does: the message on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def write_json(path: str | Path, data: object) -> None:
    """``data`` as indented JSON at ``path`` (an explicit ``--json`` file), its folder made as needed."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def write_results(out_dir: str | Path, tag: str, data: dict, text: str | None = None) -> Path:
    """``<out_dir>/<tag>.json`` (and ``<tag>.md`` with ``text``), folders made as needed; returns the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(data, indent=1) + "\n")
    if text is not None:
        (out / f"{tag}.md").write_text(text)
    return out / f"{tag}.json"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(str, r)) + " |" for r in rows
    ]


def case_parser(case: Case):
    """``(parser, module)`` of a registered case."""
    module = importlib.import_module(f"benchmarks.{case.module}")
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {case.name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    module.add_arguments(parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    """Run the case named first in ``argv`` with the rest as its arguments; list the cases without one."""
    argv = list(sys.argv[1:] if argv is None else argv)
    by_name = {c.name: c for c in CASES}
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("python -m benchmarks <case> [args]   (python -m benchmarks <case> --help: its arguments)\n")
        for c in CASES:
            print(f"  {c.name:<16} {c.measures}")
        return 0
    if argv[0] not in by_name:
        print(f"unknown case {argv[0]!r}; choose from {', '.join(by_name)}", file=sys.stderr)
        return 2
    case = by_name[argv[0]]
    if case.own_parser:  # a model run's report: exit status 1 on a MISS
        status = importlib.import_module(f"benchmarks.{case.module}").main(argv[1:])
        return (0 if status["passed"] else 1) if isinstance(status, dict) else status or 0
    parser, module = case_parser(case)
    return module.main(parser.parse_args(argv[1:])) or 0


def run_module(module: str, argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.<module> [args]``: the case that module (``__spec__.name``) runs, as earlier releases
    called it (``kernel_backends_bench --layer-step [--kernels K]`` is the ``layer-step`` case with ``--runners K``)."""
    argv, module = list(sys.argv[1:] if argv is None else argv), module.removeprefix("benchmarks.")
    (name,) = (c.name for c in CASES if c.module == module)
    if module == "kernel_backends_bench" and "--layer-step" in argv:
        argv.remove("--layer-step")
        name, argv = "layer-step", ["--runners" if a == "--kernels" else a for a in argv]
    return main([name, *argv])
