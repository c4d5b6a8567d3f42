"""What the integration runs share: command line, process group, packed batch, timed loop, report.
What it measures and how to run it: docs/benchmarks/cases.md (integration_runs/harness)."""

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.cli import run_module  # noqa: F401 (the runs' `python -m` entry)
from benchmarks.common import package_versions, sync

IGNORE_INDEX = -100

# bf16 (GPU): the two sides differ only in the attention kernel, so at step 0 the losses differ by bf16 rounding
# of the activations; later steps add the divergence of two bf16 AdamW trajectories. float64 (CPU smoke runs):
# the same math, summed in another order; Megatron computes its cross entropy in float32 (its losses agree to
# ~5e-7, its gradients to ~1e-9)
TOLERANCES = {torch.bfloat16: {"step0_loss_abs": 2e-2, "loss_abs": 5e-2, "grad_rel": 5e-2},
              torch.float64: {"step0_loss_abs": 1e-5, "loss_abs": 1e-5, "grad_rel": 1e-6}}  # fmt: skip


@dataclass(frozen=True)
class RunConfig:
    """One run's settings, from the command line."""

    device: torch.device
    dtype: torch.dtype
    tokens: int
    steps: int
    lr: float
    seed: int
    kernel_backend: str
    tiny: bool
    out: Path | None

    @property
    def shapes(self) -> dict[str, int]:
        """The decoder's sizes: a toy model, or head_dim 128 with GQA 8:2 (the shapes FA4 and cuDNN run)."""
        if self.tiny:
            return dict(vocab=97, hidden=32, ffn=64, layers=2, heads_q=4, heads_kv=2)
        return dict(vocab=8192, hidden=1024, ffn=2816, layers=4, heads_q=8, heads_kv=2)

    def dist_attn_config(self):
        """magi's DistAttnConfig with the asked kernel backend (deterministic: None -> torch's switch)."""
        from magi_attention.config import DistAttnConfig

        return DistAttnConfig(kernel_backend=self.kernel_backend)


def parse_args(name: str, doc: str, argv: list[str] | None = None) -> RunConfig:
    parser = argparse.ArgumentParser(prog=name, description=doc, formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a toy model and batch (the CPU smoke test; the default on a CPU)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the packed batch (GPU: 12288)")
    parser.add_argument("--steps", type=int, default=5, help="AdamW steps per side (the first is the warm-up)")  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernel-backend", default="auto", help="magi's DistAttnConfig.kernel_backend")
    parser.add_argument("--out", type=Path, default=None, help=f"the JSON report (default: $OUT/{name}.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    tiny = args.tiny or device.type == "cpu"
    out = args.out or (Path(os.environ["OUT"]) / f"{name}.json" if os.environ.get("OUT") else None)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is the warm-up of the timing)")
    return RunConfig(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float64,
                     tokens=args.tokens or (160 if tiny else 12288), steps=args.steps,
                     lr=args.lr if device.type == "cuda" else 1e-2, seed=args.seed,
                     kernel_backend=args.kernel_backend, tiny=tiny, out=out)  # fmt: skip


def init_world_1(device: torch.device) -> dist.ProcessGroup:
    """A one-rank default process group: NCCL on CUDA, gloo on CPU (under torchrun its variables are used)."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:  # a file rendezvous: no port to collide with other runs on the machine
            rendezvous = Path(tempfile.mkdtemp(prefix="magi_int_run_")) / "store"
            dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise SystemExit("these runs compare one process against the framework's own attention: use world size 1")  # fmt: skip
    return dist.group.WORLD


def main(name: str, doc: str, argv: list[str] | None, body: Callable[[RunConfig, dist.ProcessGroup], list[dict]],
         report: Callable[[str, RunConfig, list[dict]], dict | int] | None = None) -> dict | int:  # fmt: skip
    """A run's `main`: parse the command line, set up the world-1 group, `body(cfg, group)` (its comparisons),
    close the group, then `report(name, cfg, results)` (default :func:`finish`)."""
    cfg = parse_args(name, doc, argv)
    group = init_world_1(cfg.device)
    try:
        results = body(cfg, group)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    return (report or finish)(name, cfg, results)


@dataclass(frozen=True)
class PackedBatch:
    """Documents packed into one row: tokens, boundaries, and per-document positions and targets."""

    input_ids: torch.Tensor
    """`[1, total]` int64 token ids; `cu_seqlens` `[0, ..., total]` the document boundaries; `position_ids`
    `[1, total]` each token's index in its document; `labels` `[1, total]` the next token within the document
    (IGNORE_INDEX at each document's last token)."""
    cu_seqlens: list[int]
    position_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def doc_lens(self) -> list[int]:
        return [e - s for s, e in zip(self.cu_seqlens, self.cu_seqlens[1:])]


def packed_batch(total: int, vocab: int, *, seed: int, device: torch.device) -> PackedBatch:
    """`total` tokens of documents with log-normal lengths (median total / 8; at least 4 tokens; the last
    one takes the rest). Each document counts up from a random token with a random stride (mod vocab), so
    the loss has something to learn."""
    gen = torch.Generator().manual_seed(seed)
    median = max(total / 8, 4.0)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(math.exp(math.log(median) + 0.75 * float(torch.randn((), generator=gen))))
        lengths.append(max(4, min(n, total - sum(lengths))))
    if lengths[-1] < 4 and len(lengths) > 1:  # a 1-3 token tail joins the document before it
        lengths[-2] += lengths.pop()
    cu = [0, *itertools.accumulate(lengths)]
    docs, positions = [], []
    for n in lengths:
        start = int(torch.randint(0, vocab, (), generator=gen))
        stride = int(torch.randint(1, 5, (), generator=gen))
        docs.append((start + stride * torch.arange(n)) % vocab)
        positions.append(torch.arange(n))
    ids = torch.cat(docs)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:-1] = ids[1:]
    labels[torch.tensor(cu[1:]) - 1] = IGNORE_INDEX
    return PackedBatch(ids[None].to(device), cu, torch.cat(positions)[None].to(device), labels[None].to(device))  # fmt: skip


def token_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the non-ignored targets, in float32 at least (as the integrations' losses)."""
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX)


@dataclass
class SideResult:
    """One side's training: the loss of every step, the step-0 gradients, the timed steps."""

    losses: list[float] = field(default_factory=list)
    grads0: list[torch.Tensor] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    peak_memory_gib: float | None = None


def train(model: torch.nn.Module, step: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, steps: int,
          device: torch.device, grad_of: Callable[[torch.Tensor], torch.Tensor] = lambda g: g,
          sync_grads: Callable[[], None] = lambda: None) -> SideResult:  # fmt: skip
    """`steps` optimizer steps of `model`: `step()` (the forward, returns the loss), its backward and
    `sync_grads()` (the integration's gradient all-reduce), each timed between synchronizations; the step-0
    gradients are kept (through `grad_of`, e.g. a DTensor's full tensor)."""
    result = SideResult()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        loss = step()
        loss.backward()
        sync_grads()
        if i == 0:
            # kept in fp32 at least (bf16 gradients would round the comparison), fp64 as they are
            result.grads0 = [grad_of(p.grad).detach().to(torch.promote_types(p.grad.dtype, torch.float32)).clone()
                             for p in model.parameters()]  # fmt: skip
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        result.step_seconds.append(time.perf_counter() - t0)
        result.losses.append(float(loss.detach()))
    if device.type == "cuda":
        result.peak_memory_gib = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def train_pair(model: torch.nn.Module, magi_step: Callable[[], torch.Tensor], ref: torch.nn.Module,
               ref_step: Callable[[], torch.Tensor], cfg: RunConfig,
               grad_of: Callable[[torch.Tensor], torch.Tensor] = lambda g: g,
               sync_grads: Callable[[], None] = lambda: None) -> tuple[SideResult, SideResult]:  # fmt: skip
    """Both sides of a run, magi's first (`sync_grads` after its backward): `cfg.steps` AdamW steps (learning
    rate `cfg.lr`) of each model from its own (equal) initial weights, through :func:`train`."""
    sides = []
    for m, step, sync_m in ((model, magi_step, sync_grads), (ref, ref_step, lambda: None)):
        optimizer = torch.optim.AdamW(m.parameters(), lr=cfg.lr)
        sides.append(train(m, step, optimizer, cfg.steps, cfg.device, grad_of, sync_m))
    return sides[0], sides[1]


def grad_rel_err(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Global norm of the gradient difference over the global norm of the reference gradient."""
    if len(ours) != len(ref):
        raise ValueError(f"{len(ours)} gradients against {len(ref)}")
    diff = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(ours, ref))
    norm = sum(float(b.double().pow(2).sum()) for b in ref)
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-300)


def compare(name: str, cfg: RunConfig, batch: PackedBatch, magi: SideResult, ref: SideResult, *, ref_label: str,
            key: object, extra: dict | None = None) -> dict:  # fmt: skip
    """The numbers of one comparison and its checks (PASS/MISS against the tolerances of the dtype); `key`:
    magi's runtime key, whose kernel backend (and the reason for it) the report names."""
    from magi_attention.api import get_kernel_backend

    backend, reason = get_kernel_backend(key, cfg.dtype)
    tol = TOLERANCES[cfg.dtype]
    loss_diff = [abs(a - b) for a, b in zip(magi.losses, ref.losses)]
    grad_rel = grad_rel_err(magi.grads0, ref.grads0)
    finite = all(math.isfinite(x) for x in magi.losses) and all(bool(torch.isfinite(g).all()) for g in magi.grads0)  # fmt: skip

    def tokens_per_s(side: SideResult) -> float:
        return batch.total * (len(side.step_seconds) - 1) / sum(side.step_seconds[1:])

    checks = {
        "finite loss and step-0 gradients (magi)": finite,
        f"step-0 loss |diff| <= {tol['step0_loss_abs']:g}": loss_diff[0] <= tol["step0_loss_abs"],
        f"every step's loss |diff| <= {tol['loss_abs']:g}": max(loss_diff) <= tol["loss_abs"],
        f"step-0 gradient rel. error <= {tol['grad_rel']:g}": grad_rel <= tol["grad_rel"],
    }
    if cfg.device.type == "cpu":  # the smoke run the integrations' tests make: it must also learn something
        checks["the loss falls over the steps (CPU run)"] = len(magi.losses) > 1 and magi.losses[-1] < magi.losses[0]  # fmt: skip
    sides = {f"{k}_{side}": v for side, r in (("magi", magi), ("ref", ref)) for k, v in (("losses", r.losses),
             ("step_seconds", r.step_seconds), ("tokens_per_s", tokens_per_s(r)), ("peak_memory_gib", r.peak_memory_gib))}  # fmt: skip
    return {"name": name, "reference": ref_label,
            "device": torch.cuda.get_device_name(cfg.device) if cfg.device.type == "cuda" else "cpu",
            "dtype": str(cfg.dtype).removeprefix("torch."), "kernel_backend_asked": cfg.kernel_backend,
            "tokens": batch.total, "documents": len(batch.doc_lens), "doc_lens": batch.doc_lens, "steps": cfg.steps,
            "lr": cfg.lr, **sides, "loss_abs_diff": loss_diff, "grad_rel_err_step0": grad_rel, "tolerances": tol,
            "checks": {k: "PASS" if ok else "MISS" for k, ok in checks.items()}, "versions": versions(),
            "kernel_backend": backend.value, "kernel_reason": reason, **(extra or {})}  # fmt: skip


VERSIONED = ("transformers", "megatron-core", "torchtitan", "triton", "flash-attn-4", "nvidia-cudnn-frontend")


def versions() -> dict[str, str]:
    return {"python": sys.version.split()[0], "torch": torch.__version__, **package_versions(VERSIONED)}


def print_report(result: dict) -> None:
    """A short table: per-step losses and their difference, gradient error, tokens per second, checks."""
    print(f"\n== {result['name']}: magi vs {result['reference']} ({result['device']}, {result['dtype']}, "
          f"{result['tokens']} tokens in {result['documents']} documents; kernel: {result.get('kernel_backend')})")  # fmt: skip
    print(f"{'step':>4}  {'loss magi':>10}  {'loss ref':>10}  {'|diff|':>9}")
    for i, (a, b, d) in enumerate(zip(result["losses_magi"], result["losses_ref"], result["loss_abs_diff"])):
        print(f"{i:>4}  {a:>10.5f}  {b:>10.5f}  {d:>9.2e}")
    print(f"step-0 gradient rel. error: {result['grad_rel_err_step0']:.2e}")
    print(f"tokens/s (steps 1..{result['steps'] - 1}): magi {result['tokens_per_s_magi']:,.0f}, "
          f"ref {result['tokens_per_s_ref']:,.0f} (x{result['tokens_per_s_magi'] / result['tokens_per_s_ref']:.2f})")  # fmt: skip
    for check, verdict in result["checks"].items():
        print(f"  {verdict}  {check}")


def finish(name: str, cfg: RunConfig, results: list[dict]) -> dict:
    """Print every comparison, write `{name, runs}` as JSON to `cfg.out`; the exit status is 1 on a MISS."""
    for result in results:
        print_report(result)
    report = {"name": name, "runs": results}
    report["passed"] = all(v == "PASS" for r in results for v in r["checks"].values())
    write_report(cfg, report)
    print(f"{name}: {'PASS' if report['passed'] else 'MISS'}")
    return report


def write_report(cfg: RunConfig, report: dict) -> None:
    """``report`` as JSON at ``cfg.out`` (if set), its folder made as needed."""
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {cfg.out}")
