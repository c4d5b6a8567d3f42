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

The parts, one module each: ``report`` (what this machine runs), ``check`` (``--check``), ``bench``
(``--bench``) and ``text`` (the 80-column text); this module is the command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence

from .bench import BENCH_HEADS, BENCH_SIZES, KERNEL_API, run_bench
from .check import check_backend, kernel_fns, run_checks
from .report import BACKENDS, DISTRIBUTIONS, backend_status, collect
from .text import WIDTH, render

__all__ = [
    "BACKENDS",
    "BENCH_HEADS",
    "BENCH_SIZES",
    "DISTRIBUTIONS",
    "KERNEL_API",
    "WIDTH",
    "backend_status",
    "check_backend",
    "collect",
    "console_main",
    "kernel_fns",
    "main",
    "render",
    "run_bench",
    "run_checks",
]


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
