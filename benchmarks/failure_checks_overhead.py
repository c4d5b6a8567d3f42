"""Cost of the always-on failure checks (docs/failure_modes.md).
What it measures and how to run it: docs/benchmarks/cases.md (checks-overhead)."""

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import magi_attention.api as api
from benchmarks.cli import add_common, run_module, table
from benchmarks.common import DTYPES, host_median_ms, join_torchrun, sync
from magi_attention import config as cfg
from magi_attention.testing import failure_check_calls, failure_checks, run_distributed

TOTAL = 32768
DOCS = [0, 4096, 12288, 16384, 24576, TOTAL]


def _worker(rank: int, world: int) -> dict:
    conf = cfg.DistAttnConfig(dispatch_config=cfg.DispatchConfig(chunk_size=512))
    out = {}

    def build(shift):
        cu = [0] + [c + shift for c in DOCS[1:-1]] + [TOTAL]
        return api.magi_attn_varlen_key(cu, cu, 32, 32, 128, dist.group.WORLD, causal=True, dist_attn_config=conf)  # fmt: skip

    for label, on in (("miss_with_fingerprint", True), ("miss_without_fingerprint", False)):
        shifts = iter(range(1, 21))  # a new key each call
        with failure_checks(key_fingerprint=on):
            out[label + "_ms"] = host_median_ms(lambda shifts=shifts: build(next(shifts)), 20,
                                                lambda: (dist.barrier(), api.clear_cache()))  # fmt: skip
    key = build(1)
    dist.barrier()
    out["hit_us"] = 1e3 * host_median_ms(lambda: build(1), 200)
    q = api.dispatch(torch.zeros(TOTAL, 32, 128, dtype=torch.bfloat16), key)
    calls = failure_check_calls(key, q, q, q)
    dist.barrier()
    # the fingerprint exchange alone (one all-gather of the key's parts)
    out["fingerprint_exchange_us"] = 1e3 * host_median_ms(calls["key_fingerprint"], 50)
    # the plan built on a device, with the table check (default) and without
    for label, on in (("with", True), ("without", False)):
        with failure_checks(table_check=on):
            out[f"device_meta_{label}_table_check_ms"] = host_median_ms(calls["device_plan"], 10, dist.barrier)  # fmt: skip
    out["calc_attn_extra_checks_us"] = 1e3 * host_median_ms(calls["local_checks"], 2000)
    out["shard"] = q.shape[0]
    return out


# -- the status agreement of every call --------------------------------------------------------------------
# host-side events that wait for the device (a blocking copy's `_local_scalar_dense` is `.item()` / `.tolist()`)
_SYNC_EVENTS = frozenset(
    ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
     "aten::_local_scalar_dense")
)  # fmt: skip


def _agreement_worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    total, h, d = args.tokens, args.heads, args.head_dim
    cu = [0, *DOCS[1:-1], TOTAL] if total == TOTAL else [0, total]
    conf = cfg.DistAttnConfig(dispatch_config=cfg.DispatchConfig(chunk_size=512), kernel_backend="auto" if cuda else "torch")  # fmt: skip
    key = api.magi_attn_varlen_key(cu, cu, h, h, d, dist.group.WORLD, causal=True, dist_attn_config=conf)
    gen = torch.Generator().manual_seed(rank)
    q, k, v, do = (api.dispatch(torch.randn(total, h, d, generator=gen).to(device=device, dtype=dtype), key)
                   for _ in range(4))  # fmt: skip
    row: dict = {"world": world, "device": str(device), "dtype": args.dtype, "tokens": total, "heads": h}
    # 1. the agreement alone, as calc_attn's forward runs it (check, values, device-meta flag)
    dist.barrier()
    row["agreement_us"] = 1e3 * host_median_ms(failure_check_calls(key, q, k, v)["call_agreement"], args.agree_iters)  # fmt: skip

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out, _ = api.calc_attn(qq, kk, vv, key)
        out.backward(do)

    def timed_steps(n):
        return host_median_ms(step, n, dist.barrier, device)

    def back_to_back(n):  # the training regime: the host runs ahead, one device sync per n steps
        return host_median_ms(lambda: [step() for _ in range(n)], 1, dist.barrier, device) / n

    step()  # plan, device tensors, kernels compiled
    with failure_checks(call_agreement=False):
        step()
    on, off, on_b2b, off_b2b = [], [], [], []
    for _ in range(args.rounds):  # alternate, so drift hits both alike
        on.append(timed_steps(args.iters))
        with failure_checks(call_agreement=False):
            off.append(timed_steps(args.iters))
        if cuda:
            on_b2b.append(back_to_back(args.iters))
            with failure_checks(call_agreement=False):
                off_b2b.append(back_to_back(args.iters))
    row["step_ms_with"], row["step_ms_without"] = statistics.median(on), statistics.median(off)
    # paired (with - without) of each round: drift between rounds cancels
    row["step_ms_paired_diff"] = statistics.median(a - b for a, b in zip(on, off))
    if cuda:  # and the device synchronisations of one step, with and without the agreement
        from torch.profiler import ProfilerActivity, profile

        row["b2b_ms_with"], row["b2b_ms_without"] = statistics.median(on_b2b), statistics.median(off_b2b)
        for label, agreement in (("with", True), ("without", False)):
            with (
                failure_checks(call_agreement=agreement),
                profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
            ):
                step()
                sync(device)
            names = [e.name for e in prof.events()]
            row[f"syncs_{label}"] = sum(1 for n in names if n in _SYNC_EVENTS)
    return row


def _print_agreement(rows: list[dict]) -> None:
    r0 = rows[0]
    agreements = 2 if r0["world"] > 1 else 0  # calc_attn forward + backward (cp 1 exchanges nothing)
    share = 100 * agreements * max(r["agreement_us"] for r in rows) / 1e3 / r0["step_ms_without"]
    print(f"status agreement, world {r0['world']}, {r0['device']}, {r0['dtype']}, {r0['tokens']} tokens, "
          f"{r0['heads']} heads, varlen causal (calc_attn forward + backward)")  # fmt: skip
    print("\n".join(table(["rank", "agreement alone (us/call)", "step with (ms)", "step without (ms)",
                            "syncs with / without"], [[rank, f"{r['agreement_us']:.1f}", f"{r['step_ms_with']:.2f}",
                            f"{r['step_ms_without']:.2f}", f"{r['syncs_with']} / {r['syncs_without']}"
                            if "syncs_with" in r else "n/a (CPU)"] for rank, r in enumerate(rows)])))  # fmt: skip
    print(f"{agreements} agreements per step x the slowest rank's agreement = {share:.3f} % of the step")
    diffs = ", ".join(f"rank {i}: {r['step_ms_paired_diff']:+.2f} ms" for i, r in enumerate(rows))
    print(f"step with - without, median of the rounds' paired differences: {diffs}")
    if "b2b_ms_with" in r0:
        b2b = [(r["b2b_ms_with"], r["b2b_ms_without"]) for r in rows]
        print("steps back to back (one device sync per --iters steps), ms per step with / without: "
              + ", ".join(f"rank {i}: {w:.3f} / {wo:.3f}" for i, (w, wo) in enumerate(b2b)))  # fmt: skip


def add_arguments(p) -> None:
    add_common(p, tokens=TOTAL, head_dim=128, dtype="fp64")
    p.add_argument("--agreement", action="store_true", help="measure the per-call status agreement")
    p.add_argument("--heads", type=int, default=1, help="heads (q = kv); the CPU torch kernel is slow")
    p.add_argument("--iters", type=int, default=1, help="timed steps per round (GPU: e.g. 20)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds with / without the agreement")
    p.add_argument("--agree-iters", type=int, default=500, help="agreements timed alone")


def _torchrun_main(args: argparse.Namespace) -> None:
    join_torchrun(torch.cuda.is_available())
    row = _agreement_worker(dist.get_rank(), dist.get_world_size(), args)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        _print_agreement(rows)
    dist.destroy_process_group()


def main(args) -> None:
    """Under torchrun: the agreement on the launched ranks; else 2 gloo ranks started here."""
    if args.agreement and "RANK" in os.environ:
        return _torchrun_main(args)
    if args.agreement:
        return _print_agreement(run_distributed(_agreement_worker, 2, args, timeout=3600))
    results = run_distributed(_worker, 2, timeout=600)
    for r, res in enumerate(results):
        print(f"rank {r}: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
