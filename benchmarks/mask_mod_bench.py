"""mask_mod -> slices benchmark: wall time of `infer_attn_mask_from_mask_mod` and the slice count per mask.

    .venv/bin/python -m benchmarks.mask_mod_bench                     # CPU, every mask at 16384 x 16384
    .venv/bin/python -m benchmarks.mask_mod_bench --device cuda       # GPU: document-causal at 1M x 1M,
                                                                      # the other masks at 128K x 128K
    .venv/bin/python -m benchmarks.mask_mod_bench --device cuda --sizes 1048576 --masks doc_causal
    .venv/bin/python -m benchmarks.mask_mod_bench --json out.json     # also write JSON rows (git SHA, machine)

Masks (square, `size` queries x `size` keys, all FlexAttention-style `mask_mod` closures over tensors on the
device): `doc_causal` (causal within documents of lognormal random lengths, `size / 512` documents, at most
300, seeded), `sliding_window` (the same documents, causal window of 512 keys), `prefix_lm` (the same
documents, the first quarter of each document seen by all its rows, causal after it) and `random_rows` (each
row sees two random key intervals: no structure across rows, so about two slices per row; a mask random
element by element would give a slice per visible run, hundreds of millions at these sizes, which no slice
mask is meant for). Every element is evaluated in each case (the function's exactness contract), so the time
scales with `size**2`. One untimed warm-up call at 1024 x 1024 per mask first (CUDA start-up, kernel loads);
then the first call at full size is timed on its own (`first s`: on a GPU it includes compiling the fused
evaluation kernel for this mask and size, which later calls with the same mask_mod and size reuse) and
`seconds` is the median of `--repeat` calls after it, each ending with the slices on the host.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from magi_attention.api import infer_attn_mask_from_mask_mod
from magi_solver.demo import varlen_doc_lengths

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

WINDOW = 512
MASKS = ["doc_causal", "sliding_window", "prefix_lm", "random_rows"]
CPU_DEFAULT = {name: 16384 for name in MASKS}
# document-causal is the 1M x 1M target; the others evaluate more full-size temporaries per element
# (int64 differences, two interval tests), so they run at 128K on the GPU by default to keep the whole run
# well under two minutes
CUDA_DEFAULT = {name: 1 << 17 for name in MASKS} | {"doc_causal": 1 << 20}


def _documents(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: its document id, its document's first token, and that document's length (int64, device)."""
    lengths = torch.tensor(varlen_doc_lengths(size, max(1, min(300, size // 512)), seed=0))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return doc.to(device), first[doc].to(device), lengths[doc].to(device)


def build(name: str, size: int, device: torch.device) -> MaskMod:
    """The `mask_mod` of mask `name` over `size` tokens, its tables on `device`."""
    if name == "random_rows":
        gen = torch.Generator().manual_seed(size)
        lo = torch.randint(0, size, (2, size), generator=gen)
        hi = torch.minimum(
            lo + torch.randint(1, max(2, size // 8), (2, size), generator=gen), torch.tensor(size)
        )
        lo, hi = lo.to(device), hi.to(device)

        def random_rows(b, h, q_idx, kv_idx):
            return ((kv_idx >= lo[0][q_idx]) & (kv_idx < hi[0][q_idx])) | (
                (kv_idx >= lo[1][q_idx]) & (kv_idx < hi[1][q_idx])
            )

        return random_rows

    doc, first, length = _documents(size, device)

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def sliding_window(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    def prefix_lm(b, h, q_idx, kv_idx):
        in_prefix = kv_idx - first[kv_idx] < length[kv_idx] // 4
        return (doc[q_idx] == doc[kv_idx]) & ((q_idx >= kv_idx) | in_prefix)

    return {"doc_causal": doc_causal, "sliding_window": sliding_window, "prefix_lm": prefix_lm}[name]


@dataclass
class Row:
    mask: str
    size: int
    device: str
    seconds: float
    seconds_min: float
    first_seconds: float
    slices: int
    gelem_per_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(name: str, size: int, device: torch.device, repeat: int) -> Row:
    infer_attn_mask_from_mask_mod(build(name, 1024, device), 1024, 1024, device=device)  # warm-up
    fn = build(name, size, device)
    ts, n = [], 0
    for _ in range(repeat + 1):
        _sync(device)
        t0 = time.perf_counter()
        q, _, _ = infer_attn_mask_from_mask_mod(fn, size, size, device=device)
        _sync(device)
        ts.append(time.perf_counter() - t0)
        n = len(q)
    first, ts = ts[0], ts[1:]
    sec = statistics.median(ts)
    return Row(name, size, str(device), sec, min(ts), first, n, size * size / sec / 1e9)


def table(rows: list[Row]) -> str:
    lines = [
        "| mask | size | device | first s | seconds | slices | G elements/s |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.mask} | {r.size} | {r.device} | {r.first_seconds:.2f} | {r.seconds:.2f} | {r.slices} "
            f"| {r.gelem_per_s:.1f} |"
        )
    return "\n".join(lines)


def _machine(device: torch.device) -> str:
    cpu = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return (
        f"{cpu}{gpu}, Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="where the mask is evaluated: cpu (default), cuda, cuda:1")
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=None,
        help="square sizes, every mask at each (default: 16384 on the CPU; on a GPU doc_causal at 1048576, "
        "the others at 131072)",
    )
    p.add_argument("--masks", nargs="+", choices=MASKS, default=MASKS)
    p.add_argument(
        "--repeat", type=int, default=1, help="timed calls per case after the first (median reported)"
    )
    p.add_argument("--json", default=None, help="write JSON rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.sizes is not None and any(s <= 0 for s in args.sizes):
        p.error("--sizes must be positive")
    if args.repeat <= 0:
        p.error("--repeat must be positive")
    defaults = CUDA_DEFAULT if device.type == "cuda" else CPU_DEFAULT
    cases = [(m, s) for m in args.masks for s in (args.sizes or [defaults[m]])]

    rows = []
    t_all = time.perf_counter()
    for name, size in cases:
        row = run_one(name, size, device, args.repeat)
        rows.append(row)
        print(
            f"{name} {size} x {size} on {device}: first call {row.first_seconds:.2f} s, then {row.seconds:.2f} s, "
            f"{row.slices} slices",
            flush=True,
        )
    total = time.perf_counter() - t_all
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    machine = _machine(device)
    print(f"\ngit {sha}; {machine}; whole run {total:.1f} s")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sha": sha, "machine": machine, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
