"""GroupCast / GroupReduce over NCCL equal the same tables run over gloo (and the plain-torch references).

One process per GPU: ``torchrun --standalone --nproc-per-node N benchmarks/gpu_group_collective_check.py``.
Every rank builds the same random tables (empty pieces, multicast to every rank, silent and deaf ranks), runs
each collective once on CUDA tensors over the default NCCL group and once on CPU copies over a gloo group of
the same ranks, and compares: GroupCast bit-exact, GroupReduce sum / avg / lse to 1e-6 (the summation order
may differ), both against `magi_group_collective.testing`'s references. ``--device cpu`` runs both sides over
gloo (a smoke test of the script itself). Prints one line per case and a summary last; exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from magi_group_collective import group_cast, group_reduce
from magi_group_collective.testing import RankCastTables, random_cast_tables, reference_cast, reference_reduce

for _name, _value in {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(_name, _value)

TRAILING = (3, 8)  # [tokens, heads, dim] pieces, as K/V and dK/dV travel


def _all(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's tensor (they differ in length): pad to the longest, all-gather, cut."""
    world = dist.get_world_size()
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return [p[: int(s.item())] for p, s in zip(parts, sizes)]


def check_case(
    tables: list[RankCastTables], seed: int, device: torch.device, gloo
) -> list[tuple[str, float]]:
    """(name, max abs difference) per collective of one table set; 0.0 means bit-exact."""
    rank = dist.get_rank()
    t = tables[rank]
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(sum(t.input_split_sizes), *TRAILING, generator=gen)
    results = []
    # GroupCast: NCCL (device) vs gloo (CPU) vs reference
    out_dev = torch.full((sum(t.output_split_sizes), *TRAILING), float("nan"), device=device)
    group_cast(x.to(device), out_dev, *t.args()).wait()
    out_cpu = torch.full((sum(t.output_split_sizes), *TRAILING), float("nan"))
    group_cast(x, out_cpu, *t.args(), group=gloo).wait()
    ref = reference_cast(tables, [p.cpu() for p in _all(x.to(device))], rank)
    results.append(
        ("cast nccl == gloo", (out_dev.cpu() - out_cpu).abs().max().item() if out_cpu.numel() else 0.0)
    )
    results.append(("cast == reference", (out_cpu - ref).abs().max().item() if ref.numel() else 0.0))
    # GroupReduce with the transposed tables: sum, avg, lse
    y = torch.randn(sum(t.output_split_sizes), *TRAILING, generator=gen)
    base = torch.randn(sum(t.input_split_sizes), *TRAILING, generator=gen)
    y_lse = torch.randn(y.shape[:2], generator=gen)
    base_lse = torch.randn(base.shape[:2], generator=gen)
    all_y = [p.cpu() for p in _all(y.to(device))]
    all_y_lse = [p.cpu() for p in _all(y_lse.to(device))]
    for op in ("sum", "avg", "lse"):
        extra = {}
        outs = {}
        for side, dev, grp in (("nccl", device, None), ("gloo", torch.device("cpu"), gloo)):
            out = base.clone().to(dev)
            if op == "lse":
                extra = {"input_lse": y_lse.to(dev), "output_lse": base_lse.clone().to(dev)}
            group_reduce(y.to(dev), out, *t.transpose_args(), group=grp, reduce_op=op, **extra).wait()
            outs[side] = (out.cpu(), extra.get("output_lse"))
        want, want_lse = reference_reduce(
            tables,
            all_y,
            base,
            rank,
            op,
            all_y_lse if op == "lse" else None,
            base_lse if op == "lse" else None,
        )
        diff = (outs["nccl"][0] - outs["gloo"][0]).abs().max().item() if base.numel() else 0.0
        ref_diff = (outs["gloo"][0].double() - want).abs().max().item() if base.numel() else 0.0
        if op == "lse" and base.numel():
            diff = max(diff, (outs["nccl"][1].cpu() - outs["gloo"][1].cpu()).abs().max().item())
            ref_diff = max(ref_diff, (outs["gloo"][1].cpu().double() - want_lse).abs().max().item())
        results.append((f"reduce {op} nccl == gloo", diff))
        results.append((f"reduce {op} == reference", ref_diff))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seeds", type=int, default=20)
    a = ap.parse_args()
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    gloo = dist.new_group(backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    worst: dict[str, float] = {}
    for seed in range(a.seeds):
        for name, diff in check_case(random_cast_tables(world, seed), seed, device, gloo):
            worst[name] = max(worst.get(name, 0.0), diff)
    failures = [n for n, d in worst.items() if not d <= (0.0 if n.startswith("cast") else 1e-5)]
    flag = torch.tensor([len(failures)], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        for name, d in worst.items():
            print(f"{'ok  ' if name not in failures else 'FAIL'} {name:28s} max |diff| {d:.1e}")
        print(
            f"gpu_group_collective_check: world {world}, {a.seeds} table sets, {int(flag.item())} failures "
            f"({a.device} vs gloo)"
        )
    dist.barrier(group=gloo)
    # leave without running C++ destructors: tearing down a second gloo group at interpreter exit can abort
    # the process ("terminate called without an active exception") after every check has passed
    sys.stdout.flush()
    os._exit(1 if int(flag.item()) else 0)


if __name__ == "__main__":
    sys.exit(main())
