"""GroupCast benchmark: comm-plan bytes against ring / all-gather K/V, and GroupCast / GroupReduce bandwidth.
What it measures and how to run it: docs/benchmarks/cases.md (grpcoll)."""

import platform
import sys
from collections import namedtuple
from collections.abc import Callable

import numpy as np

from benchmarks.cli import run_module, table, write_json

BYTES_PER_TOKEN = 2 * 8 * 128 * 2  # K and V, 8 KV heads, head_dim 128, bf16
RANKS_PER_NODE = 8


def _masks() -> dict[str, Callable[[int], tuple]]:
    from magi_solver import make_block_causal_mask, make_sliding_window_mask, make_varlen_causal_mask
    from magi_solver.demo import varlen_doc_lengths

    def cu(n: int) -> list[int]:
        return np.concatenate([[0], np.cumsum(varlen_doc_lengths(n, 300, seed=0))]).tolist()

    return {
        "varlen_causal": lambda n: tuple(make_varlen_causal_mask(cu(n))),
        "block_causal_b4096": lambda n: tuple(make_block_causal_mask(list(range(0, n + 1, n // 8)), 4096)),
        "swa_causal_w1024": lambda n: tuple(make_sliding_window_mask(cu(n), (1024, 0))),
    }


def cast_tables(mask: str, total: int, cp: int, chunk: int) -> list[tuple]:
    """Per rank: (input_split_sizes, output_split_sizes, dst_indices, src_index) of the merged stage."""
    from magi_solver import PlanOptions, plan_attention

    options = PlanOptions(overlap_degree=0)
    plan = plan_attention(*_masks()[mask](total), total, cp, chunk_size=chunk, options=options)
    out = []
    for rp in plan.ranks:
        a = rp.stages[0].cast
        out.append((list(a.input_split_sizes), list(a.output_split_sizes), [list(d) for d in a.dst_indices],
                    list(a.src_index)))  # fmt: skip
    return out


BytesRow = namedtuple("BytesRow", "mask cp sent_max sent_mean recv_max ring inter_flat_max inter_hier_max")
"""One (mask, cp) row of the bytes table: tokens each rank sends / receives, the ring's, the inter-node ones."""


def bytes_rows(total: int, cps: list[int], chunk: int) -> list[BytesRow]:
    rows = []
    for mask in _masks():
        for cp in cps:
            tabs = cast_tables(mask, total, cp, chunk)
            sent, recv, inter_flat, inter_hier = [], [], [], []
            for s, (ins, outs, dsts, _src) in enumerate(tabs):
                sent.append(sum(n * len(d) for n, d in zip(ins, dsts)))
                recv.append(sum(outs))
                node = s // RANKS_PER_NODE
                inter_flat.append(sum(n * sum(d // RANKS_PER_NODE != node for d in ds) for n, ds in zip(ins, dsts)))  # fmt: skip
                inter_hier.append(sum(n * len({d // RANKS_PER_NODE for d in ds} - {node}) for n, ds in zip(ins, dsts)))  # fmt: skip
            shard = total // cp
            rows.append(BytesRow(mask, cp, max(sent), sum(sent) / cp, max(recv), (cp - 1) * shard,
                                 max(inter_flat), max(inter_hier)))  # fmt: skip
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return rows


def _mib(tokens: float) -> str:
    return f"{tokens * BYTES_PER_TOKEN / 2**20:,.0f}"


def bytes_table(rows: list[BytesRow]) -> str:
    return "\n".join(table(["mask", "cp", "GroupCast sent MiB/rank max (mean)", "recv max", "ring = all-gather",
                             "GroupCast / ring", "inter-node MiB/rank, flat a2a", "hierarchical"],
                            [[r.mask, r.cp, f"{_mib(r.sent_max)} ({_mib(r.sent_mean)})", _mib(r.recv_max), _mib(r.ring),
                              f"{r.sent_max / r.ring:.2f}", _mib(r.inter_flat_max), _mib(r.inter_hier_max)] for r in rows]))  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# GPU bandwidth: native against all-to-all-v, under torchrun (NCCL)


def bandwidth_tables(world: int, rank: int, tokens: int, pieces: int = 32) -> tuple:
    """(input_split_sizes, output_split_sizes, dst_indices, src_index) of ``rank``: every rank's input is
    ``pieces`` equal pieces of ``tokens // pieces`` tokens; piece ``i`` odd goes to rank ``(r + 1 + i // 2)
    mod`` the other ranks, even pieces stay unsent. Receivers list pieces source by source."""
    n = max(1, tokens // pieces)

    def dst(r: int, i: int) -> list[int]:
        if i % 2 == 0 or world == 1:
            return []
        others = [q for q in range(world) if q != r]
        return [others[(i // 2) % len(others)]]

    ins = [n] * pieces
    dsts = [dst(rank, i) for i in range(pieces)]
    outs, src = [], []
    for s in range(world):
        for i in range(pieces):
            if rank in dst(s, i):
                outs.append(n)
                src.append(s)
    return ins, outs, dsts, src


def _bandwidth_row(mb: int, world: int, rank: int, dev, row: tuple, token_bytes: int, timed) -> dict:
    """One size of the GPU bandwidth table (see the module docstring); every rank returns the same row."""
    import torch
    import torch.distributed as dist

    from magi_group_collective import GroupCastPlan, _symmetric

    tokens = 2 * (mb << 20) // token_bytes  # the input holds twice what is sent
    ins, outs, dsts, src = bandwidth_tables(world, rank, tokens)
    x = torch.randn(sum(ins), *row, device=dev).to(torch.bfloat16)
    sent = sum(n * len(d) for n, d in zip(ins, dsts)) * token_bytes
    plans = {impl: GroupCastPlan(ins, outs, dsts, src, impl=impl) for impl in ("a2av", "native")}
    reds = {impl: p.transpose() for impl, p in plans.items()}
    out = {impl: torch.empty(sum(outs), *row, device=dev, dtype=torch.bfloat16) for impl in plans}
    acc = {impl: torch.zeros_like(x) for impl in plans}
    send_splits = [sum(n for n, d in zip(ins, dsts) if q in d) for q in range(world)]
    recv_splits = [sum(n for n, s in zip(outs, src) if s == q) for q in range(world)]
    a2a_in = torch.empty(sum(send_splits), *row, device=dev, dtype=torch.bfloat16)
    a2a_out = torch.empty(sum(recv_splits), *row, device=dev, dtype=torch.bfloat16)
    for impl, p in plans.items():  # warm-up call: the native buffer grows here, outside the timing
        p.cast(x, out[impl])
        reds[impl].reduce(out[impl], acc[impl], reduce_op="sum")
    torch.cuda.synchronize()
    same = torch.equal(out["a2av"].view(torch.int16), out["native"].view(torch.int16))
    result = {"mb": mb, "bytes_sent": sent, "cast_bitwise_equal": same}
    result["nccl_a2a_s"] = timed(lambda: dist.all_to_all_single(a2a_out, a2a_in, recv_splits, send_splits))
    capacity = [b.capacity for _, b in _symmetric._BUFFERS.values()]
    gathers = [0]
    real_gather = dist.all_gather_object

    def counting(*a, **k):
        gathers[0] += 1
        return real_gather(*a, **k)

    dist.all_gather_object = counting  # the timed calls must do no rendezvous
    try:
        for impl in ("a2av", "native"):
            p, r, o, a = plans[impl], reds[impl], out[impl], acc[impl]
            result[f"cast_{impl}_s"] = timed(lambda p=p, o=o: p.cast(x, o))
            result[f"reduce_{impl}_s"] = timed(lambda r=r, o=o, a=a: r.reduce(o, a, reduce_op="sum"))
    finally:
        dist.all_gather_object = real_gather
    result["native_rendezvous"] = gathers[0]
    result["native_buffer_stable"] = capacity == [b.capacity for _, b in _symmetric._BUFFERS.values()]
    return result


def gpu_bandwidth(args) -> int:
    import torch
    import torch.distributed as dist

    from benchmarks.common import events_loop_ms, join_torchrun
    from magi_group_collective import release_native_buffers

    dev = join_torchrun(cuda=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    row = (2 * 8, 128)  # K and V of 8 heads x 128, bf16: 4 KiB per token (BYTES_PER_TOKEN)
    results = []

    def timed(fn) -> float:
        t = torch.tensor([events_loop_ms(fn, args.iters, args.warmup)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() / 1e3  # seconds per call, slowest rank

    for mb in (int(v) for v in args.sizes_mb.split(",")):
        results.append(_bandwidth_row(mb, world, rank, dev, row, BYTES_PER_TOKEN, timed))
        torch.cuda.empty_cache()
    if rank == 0:
        import triton

        gbs = lambda r, k: r["bytes_sent"] / r[k] / 1e9  # noqa: E731
        name = torch.cuda.get_device_name(dev)
        print(f"group collective bandwidth: {world} x {name}, torch {torch.__version__}, triton {triton.__version__}, "
              f"bf16 rows of 4 KiB, {args.iters} calls after {args.warmup}; GB/s = bytes each rank sends / time")  # fmt: skip
        body = []
        for r in results:
            checks = (f"cast bits {'equal' if r['cast_bitwise_equal'] else 'DIFFER'}, rendezvous "
                      f"{r['native_rendezvous']}, buffer {'stable' if r['native_buffer_stable'] else 'GREW'}")  # fmt: skip
            for op in ("cast", "reduce"):
                a, n = gbs(r, f"{op}_a2av_s"), gbs(r, f"{op}_native_s")
                body.append([f"Group{op.capitalize()}", r["mb"], f"{gbs(r, 'nccl_a2a_s'):.0f}", f"{a:.0f}", f"{n:.0f}",
                             f"{n / a:.2f}", checks])  # fmt: skip
        print("\n".join(table(["op", "MiB sent/rank", "NCCL all_to_all_single", "a2av", "native", "native / a2av",
                                "checks"], body)))  # fmt: skip
        if args.json:
            write_json(args.json, {"device": name, "world": world, "torch": torch.__version__, "rows": results})  # fmt: skip
    ok = all(r["cast_bitwise_equal"] and r["native_rendezvous"] == 0 and r["native_buffer_stable"] for r in results)  # fmt: skip
    release_native_buffers()
    dist.destroy_process_group()
    return 0 if ok else 1


def add_arguments(p) -> None:
    p.add_argument("--total", type=int, default=1 << 20, help="tokens for the bytes table")
    p.add_argument("--cp", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="write JSON rows here")
    p.add_argument("--gpu-bandwidth", action="store_true", help="under torchrun on GPUs: native vs a2av GB/s")
    p.add_argument("--sizes-mb", default="8,64,512", help="--gpu-bandwidth: MiB each rank sends")


def main(args) -> int:
    if args.gpu_bandwidth:
        return gpu_bandwidth(args)
    import os

    import torch

    from benchmarks.common import git_sha

    brows, sha = bytes_rows(args.total, args.cp, args.chunk), git_sha()
    machine = f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"  # fmt: skip
    print(f"bytes: {args.total:,} tokens, chunk {args.chunk}, {BYTES_PER_TOKEN} B/token; git {sha}; {machine}")  # fmt: skip
    print(bytes_table(brows))
    if args.json:
        write_json(args.json, {"sha": sha, "machine": machine, "bytes": [r._asdict() for r in brows],
                                "args": vars(args)})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
