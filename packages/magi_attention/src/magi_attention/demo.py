"""The main job: train a small transformer for a few steps with context parallelism.

A long packed batch of documents with a varlen block-causal mask (each document is a short video:
blocks of frames attend to every earlier block of the same document) is trained for a few steps with
context parallelism over 4 CPU processes (gloo) when there is no GPU, or over every GPU (NCCL) when there
are. Loss and gradients are checked against a single-process run of the same model; per-rank compute
balance and communication volume are compared with ring attention and all-gather K/V.

    python -m magi_attention.demo [--tokens 8192] [--steps 4] [--cp 4]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# the package's own names, imported as a training script would; the runtime cache only to report the plan
from magi_attention import (
    DispatchConfig,
    DistAttnConfig,
    OverlapConfig,
    calc_attn,
    dispatch,
    get_position_ids,
    magi_attn_flex_key,
    undispatch,
)
from magi_attention._runtime.cache import RUNTIME_CACHE
from magi_attention.testing import run_distributed
from magi_solver import lognormal_doc_lengths


@dataclass(frozen=True)
class DemoConfig:
    tokens: int = 8192
    steps: int = 4
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads_q: int = 4
    heads_kv: int = 2
    frame_block: int = 128
    chunk_size: int = 128
    seed: int = 0


def video_batch_mask(total: int, block: int, seed: int):
    """Packed documents with long-tailed lengths (multiples of `block`), block-causal inside each."""
    # log-normal block counts (median e^1.2 ~ 3.3 blocks, sigma 0.9), at most a quarter of the batch each
    lengths = lognormal_doc_lengths(
        total, median=math.exp(1.2), sigma=0.9, seed=seed, floor=1, cap=total // (4 * block), unit=block
    )
    q_ranges, k_ranges = [], []
    start = 0
    for length in lengths:
        end = start + length
        for s in range(start, end, block):
            q_ranges.append([s, min(s + block, end)])
            k_ranges.append([start, min(s + block, end)])
        start = end
    return q_ranges, k_ranges, ["full"] * len(q_ranges)


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding; `pos` are global token positions (dispatch permutes tokens)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype, device=x.device) / half))
    ang = pos.to(x.dtype)[:, None] * freqs[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.heads_q, cfg.heads_kv, cfg.dim // cfg.heads_q
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, (self.hq + 2 * self.hkv) * self.d, bias=False)
        self.proj = nn.Linear(self.hq * self.d, cfg.dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, key) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q = rope(q.view(t, self.hq, self.d), pos)
        k = rope(k.view(t, self.hkv, self.d), pos)
        out, _ = calc_attn(q.contiguous(), k.contiguous(), v.reshape(t, self.hkv, self.d).contiguous(), key)
        x = x + self.proj(out.reshape(t, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, key) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, pos, key)
        return self.head(x)


def _make_data(cfg: DemoConfig, device: torch.device):
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, cfg.vocab, (cfg.steps, cfg.tokens + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _train(cfg: DemoConfig, dtype: torch.dtype, device: torch.device, group, show_progress: bool):
    """Train for cfg.steps; return per-step losses, the first step's gradients and the key."""
    torch.manual_seed(cfg.seed)
    model = TinyLM(cfg).to(device=device, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    q_ranges, k_ranges, types = video_batch_mask(cfg.tokens, cfg.frame_block, cfg.seed)
    d = cfg.dim // cfg.heads_q
    config = DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=cfg.chunk_size), overlap_config=OverlapConfig(degree=2)
    )
    key = magi_attn_flex_key(
        q_ranges, k_ranges, types, cfg.tokens, cfg.tokens, cfg.heads_q, cfg.heads_kv, d, group, config
    )
    pos = get_position_ids(key).to(device)
    inputs, labels = _make_data(cfg, device)
    losses, first_grads = [], None
    steps = range(cfg.steps)
    if show_progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"training cp={key.cp_size}", unit="step")
    for step in steps:
        logits = model(dispatch(inputs[step], key), pos, key)
        # Sum of local token losses, then a sum over ranks: the global mean loss on every rank.
        # fp32 at least for the loss (bf16 on GPUs); fp64 stays fp64 so the CPU check is exact.
        logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        local_loss = F.cross_entropy(logits, dispatch(labels[step], key), reduction="none")
        loss = local_loss[: _num_real_local_tokens(key)].sum() / cfg.tokens

        opt.zero_grad()
        loss.backward()
        if key.cp_size > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=group)
        if first_grads is None:
            first_grads = {n: p.grad.detach().double().cpu().clone() for n, p in model.named_parameters()}
        losses.append(float(loss.detach()))
        opt.step()
    # The full output gathered back in global order, as a last check of undispatch.
    final = undispatch(model(dispatch(inputs[0], key), pos, key).detach(), key).double().cpu()
    return losses, first_grads, key, final


def _num_real_local_tokens(key) -> int:
    """Local tokens in ascending global order put padding (ids >= total) last: count the real ones."""
    runtime = RUNTIME_CACHE.get(key)
    ids = runtime.layout.local_token_ids(runtime.rank)
    return int((ids < runtime.layout.total_seqlen).sum())


def _rank_main(rank: int, world_size: int, cfg: DemoConfig, use_cuda: bool):
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if use_cuda else torch.float64
    t0 = time.perf_counter()
    losses, grads, key, final = _train(cfg, dtype, device, dist.group.WORLD, show_progress=rank == 0)
    elapsed = time.perf_counter() - t0
    plan = RUNTIME_CACHE.get(key).plan
    return {
        "losses": losses,
        "grads": grads,
        "final": final,
        "elapsed": elapsed,
        "plan": plan if rank == 0 else None,
    }


def _report_plan(plan, cfg: DemoConfig) -> None:
    cp = len(plan.ranks)
    areas = [r.host_area + sum(s.area for s in r.stages) for r in plan.ranks]
    remote = [sum(s.num_remote_tokens for s in r.stages) for r in plan.ranks]
    shard = cfg.tokens // cp
    ring = (cp - 1) * shard  # ring attention passes every other shard's K/V through every rank
    print(f"\nper-rank plan (cp={cp}, {cfg.tokens} tokens, chunk {cfg.chunk_size}):")
    print(f"{'rank':>4} {'mask area':>10} {'vs mean':>8} {'remote K/V tokens':>18} {'ring / all-gather':>18}")
    mean = sum(areas) / cp
    for r in range(cp):
        print(f"{r:>4} {areas[r]:>10} {areas[r] / mean:>8.3f} {remote[r]:>18} {ring:>18}")
    total_remote = sum(remote)
    print(
        f"compute imbalance (max/mean) {max(areas) / mean:.3f}; K/V tokens moved: magi {total_remote}, "
        f"ring {ring * cp} ({total_remote / max(1, ring * cp):.1%} of ring)"
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=DemoConfig.tokens)
    parser.add_argument("--steps", type=int, default=DemoConfig.steps)
    parser.add_argument("--cp", type=int, default=None, help="ranks (default: #GPUs, or 4 on CPU)")
    args = parser.parse_args(argv)
    cfg = DemoConfig(tokens=args.tokens, steps=args.steps)
    use_cuda = torch.cuda.is_available()
    cp = args.cp or (torch.cuda.device_count() if use_cuda else 4)
    backend = "nccl" if use_cuda else "gloo"
    print(f"magi-attention demo: {cfg.tokens} tokens, {cfg.steps} steps, cp={cp} over {backend}")
    t0 = time.perf_counter()
    results = run_distributed(_rank_main, cp, cfg, use_cuda, backend=backend)
    ref_device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    ref_losses, ref_grads, _, ref_final = _train(
        cfg, torch.bfloat16 if use_cuda else torch.float64, ref_device, None, show_progress=True
    )
    tol = 3e-2 if use_cuda else 1e-9
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(results[0]["losses"], ref_losses))
    worst_grad = max(_rel(results[0]["grads"][n], g) for n, g in ref_grads.items())
    worst_out = _rel(results[0]["final"], ref_final)
    print("\nstep  loss(cp)    loss(single)")
    for i, (a, b) in enumerate(zip(results[0]["losses"], ref_losses)):
        print(f"{i:>4}  {a:.8f}  {b:.8f}")
    print(
        f"max rel err: loss {worst_loss:.2e}, grads {worst_grad:.2e}, outputs {worst_out:.2e} (tolerance {tol:g})"
    )
    _report_plan(results[0]["plan"], cfg)
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    ok = worst_loss < tol and worst_grad < tol and worst_out < tol
    print("RESULT:", "OK, context-parallel training matches the single-process run" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
