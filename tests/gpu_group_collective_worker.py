"""GroupCast / GroupReduce over NCCL equal the same tables run over gloo (and the plain-torch references).

A worker of ``tests/test_gpu_checks.py`` (which runs it and grades its JSON verdict), one process per GPU:
``torchrun --standalone --nproc-per-node N tests/gpu_group_collective_worker.py``.
Every rank builds the same random tables (empty pieces, multicast to every rank, silent and deaf ranks), runs
each collective once on CUDA tensors over the default NCCL group and once on CPU copies over a gloo group of
the same ranks, and compares: GroupCast bit-exact, GroupReduce sum / avg / lse to 1e-6 (the summation order
may differ), both against `magi_group_collective.testing`'s references. ``--device cpu`` runs both sides over
gloo (a smoke test of the script itself). ``--impl native`` runs the native implementation (symmetric memory)
on the device side and adds: native == a2av on the device (cast bit-exact, reduce to 1e-5), a second native
run with ``async_op=True`` bitwise equal to the first, and (``--big-seeds N``) tens of MB per rank so the
native buffer grows. Prints one line per case and a summary last; exits 1 on a mismatch; ``--out FILE`` writes
``{"failed": n on every rank, "failures": [...], "worst": {case: max |diff|}}`` as JSON (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from magi_group_collective import GroupCastPlan, GroupReducePlan, release_native_buffers
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


def _cast(t: RankCastTables, x: torch.Tensor, group, impl: str, async_op: bool = False) -> torch.Tensor:
    out = torch.full((sum(t.output_split_sizes), *x.shape[1:]), 7, dtype=x.dtype, device=x.device)
    plan = GroupCastPlan(*t.args(), group=group, impl=impl, device=x.device)
    plan.cast(x, out, async_op=async_op).wait()
    return out


def _reduce(t: RankCastTables, y, base, op, y_lse, base_lse, group, impl: str, async_op: bool = False):
    plan = GroupReducePlan(*t.transpose_args(), group=group, impl=impl, device=y.device)
    out = base.clone()
    extra = {}
    if op == "lse":
        extra = {"input_lse": y_lse, "output_lse": base_lse.clone()}
    plan.reduce(y, out, reduce_op=op, async_op=async_op, **extra).wait()
    return out, extra.get("output_lse")


def _bits_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """0.0 when the bit patterns agree (NaN included), else the largest |difference| (inf if NaN differs)."""
    if a.numel() == 0:
        return 0.0
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    if torch.equal(a.cpu().view(word), b.cpu().view(word)):
        return 0.0
    d = (a.cpu().double() - b.cpu().double()).abs().max().item()
    return d if d == d and d > 0 else float("inf")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.cpu().double() - b.cpu().double()).abs().max().item() if a.numel() else 0.0


def check_case(
    tables: list[RankCastTables],
    seed: int,
    device: torch.device,
    gloo,
    impl: str = "a2av",
    trailing: tuple[int, ...] = TRAILING,
    cast_dtype: torch.dtype = torch.float32,
) -> list[tuple[str, float]]:
    """(name, max abs difference) per collective of one table set; 0.0 means bit-exact.

    ``impl`` runs on ``device`` over the default group; the gloo side always runs a2av on CPU. With
    ``impl="native"`` the native results are also compared with a2av on ``device`` (cast bit-exact, reduce
    within fp32 rounding) and with a second native run (bitwise), and the cast also runs with async_op.
    """
    rank = dist.get_rank()
    t = tables[rank]
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if cast_dtype.is_floating_point and cast_dtype.itemsize == 2:  # random bit patterns must arrive exact
        x = torch.randint(
            -(2**15), 2**15, (sum(t.input_split_sizes), *trailing), generator=gen, dtype=torch.int16
        )
        x = x.view(cast_dtype)
    else:
        x = torch.randn(sum(t.input_split_sizes), *trailing, generator=gen).to(cast_dtype)
    results = []
    # GroupCast: device vs gloo (CPU) vs reference
    out_dev = _cast(t, x.to(device), None, impl)
    out_cpu = _cast(t, x, gloo, "a2av")
    ref = reference_cast(tables, [p.cpu() for p in _all(x.to(device))], rank)
    results.append(("cast nccl == gloo", _bits_diff(out_dev, out_cpu)))
    results.append(("cast == reference", _bits_diff(out_cpu, ref)))
    if impl == "native":
        a2av = _cast(t, x.to(device), None, "a2av")
        results.append(("cast native == a2av nccl", _bits_diff(out_dev, a2av)))
        results.append(
            ("cast native async == a2av", _bits_diff(_cast(t, x.to(device), None, impl, True), a2av))
        )
    # GroupReduce with the transposed tables: sum, avg, lse
    y = torch.randn(sum(t.output_split_sizes), *trailing, generator=gen)
    base = torch.randn(sum(t.input_split_sizes), *trailing, generator=gen)
    y_lse = torch.randn(y.shape[:2], generator=gen)
    base_lse = torch.randn(base.shape[:2], generator=gen)
    all_y = [p.cpu() for p in _all(y.to(device))]
    all_y_lse = [p.cpu() for p in _all(y_lse.to(device))]
    yd, bd, yld, bld = y.to(device), base.to(device), y_lse.to(device), base_lse.to(device)
    for op in ("sum", "avg", "lse"):
        dev_out, dev_lse = _reduce(t, yd, bd, op, yld, bld, None, impl)
        cpu_out, cpu_lse = _reduce(t, y, base, op, y_lse, base_lse, gloo, "a2av")
        want, want_lse = reference_reduce(
            tables,
            all_y,
            base,
            rank,
            op,
            all_y_lse if op == "lse" else None,
            base_lse if op == "lse" else None,
        )
        diff = _max_diff(dev_out, cpu_out)
        ref_diff = _max_diff(cpu_out, want)
        if op == "lse":
            diff = max(diff, _max_diff(dev_lse, cpu_lse))
            ref_diff = max(ref_diff, _max_diff(cpu_lse, want_lse))
        results.append((f"reduce {op} nccl == gloo", diff))
        results.append((f"reduce {op} == reference", ref_diff))
        if impl == "native":
            a_out, a_lse = _reduce(t, yd, bd, op, yld, bld, None, "a2av")
            again, again_lse = _reduce(t, yd, bd, op, yld, bld, None, impl, async_op=True)
            d_a2av, d_rep = _max_diff(dev_out, a_out), _bits_diff(dev_out, again)
            if op == "lse":
                d_a2av = max(d_a2av, _max_diff(dev_lse, a_lse))
                d_rep = max(d_rep, _bits_diff(dev_lse, again_lse))
            results.append((f"reduce {op} native == a2av nccl", d_a2av))
            results.append((f"reduce {op} native repeat (bits)", d_rep))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument(
        "--impl",
        choices=("a2av", "native"),
        default="a2av",
        help="implementation on the device side (native: also compared with a2av on the device)",
    )
    ap.add_argument(
        "--big-seeds",
        type=int,
        default=0,
        help="also this many table sets with pieces of up to 8192 tokens of [8, 128] (bf16 cast, fp32 reduce; "
        "tens of MB per rank: the native buffer grows)",
    )
    ap.add_argument("--out", default=None, help="JSON verdict (rank 0)")
    a = ap.parse_args()
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        if a.impl == "native":
            ap.error("--impl native needs --device cuda")
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    gloo = dist.new_group(backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    worst: dict[str, float] = {}
    cases = [(random_cast_tables(world, seed), seed, TRAILING, torch.float32) for seed in range(a.seeds)]
    cases += [
        (random_cast_tables(world, 1000 + s, max_pieces=4, max_size=8192), 1000 + s, (8, 128), torch.bfloat16)
        for s in range(a.big_seeds)
    ]
    for tables, seed, trailing, cast_dtype in cases:
        for name, diff in check_case(tables, seed, device, gloo, a.impl, trailing, cast_dtype):
            worst[name] = max(worst.get(name, 0.0), diff)
    failures = [
        n for n, d in worst.items() if not d <= (0.0 if n.startswith("cast") or "bits" in n else 1e-5)
    ]
    flag = torch.tensor([len(failures)], device=device)
    dist.all_reduce(flag)
    if rank == 0:
        for name, d in worst.items():
            print(f"{'ok  ' if name not in failures else 'FAIL'} {name:34s} max |diff| {d:.1e}")
        print(
            f"gpu_group_collective_check: world {world}, {len(cases)} table sets, {int(flag.item())} failures "
            f"({a.device} {a.impl} vs gloo)"
        )
        if a.out:
            with open(a.out, "w") as f:
                json.dump(
                    {
                        "failed": int(flag.item()),
                        "failures": failures,
                        "worst": worst,
                        "table_sets": len(cases),
                    },
                    f,
                    indent=1,
                )
    if a.impl == "native":
        release_native_buffers()  # collective, while every rank is still here
    dist.barrier(group=gloo)
    # leave without running C++ destructors: tearing down a second gloo group at interpreter exit can abort
    # the process ("terminate called without an active exception") after every check has passed
    sys.stdout.flush()
    os._exit(1 if int(flag.item()) else 0)


if __name__ == "__main__":
    sys.exit(main())
