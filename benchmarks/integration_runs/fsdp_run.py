"""FSDP2 with magi-attention against the same model's own attention (SDPA on each document), one process.
What it measures and how to run it: docs/benchmarks/cases.md (fsdp)."""

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.integration_runs import harness

NAME = "fsdp"


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` `[tokens, heads, head_dim]` at positions `pos` `[tokens]` (angles in fp32)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / 10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = pos.float()[:, None] * freqs[None]
    cos, sin = ang.cos().to(x.dtype)[:, None], ang.sin().to(x.dtype)[:, None]
    return torch.cat([x[..., :half] * cos - x[..., half:] * sin, x[..., :half] * sin + x[..., half:] * cos], -1)  # fmt: skip


class Block(nn.Module):
    def __init__(self, dim: int, heads_q: int, heads_kv: int) -> None:
        super().__init__()
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, dim // heads_q
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads_q + 2 * heads_kv) * self.head_dim, bias=False)
        self.proj = nn.Linear(heads_q * self.head_dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim))

    def attention(self, q, k, v, key, cu_seqlens):
        if key is not None:  # magi: every document of the pack in one call
            from magi_attention.api import calc_attn

            return calc_attn(q, k, v, key)[0]
        outs = []  # the model's own attention: SDPA on each document alone
        for s, e in pairwise(cu_seqlens):
            q_d, k_d, v_d = (x[s:e].transpose(0, 1) for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(q_d, k_d, v_d, is_causal=True, enable_gqa=True).transpose(0, 1))  # fmt: skip
        return torch.cat(outs)

    def forward(self, x, pos, key, cu_seqlens):
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([self.heads_q * d, self.heads_kv * d, self.heads_kv * d], -1)
        q, k = rope(q.view(t, self.heads_q, d), pos), rope(k.view(t, self.heads_kv, d), pos)
        out = self.attention(
            q.contiguous(), k.contiguous(), v.reshape(t, self.heads_kv, d).contiguous(), key, cu_seqlens
        )
        x = x + self.proj(out.reshape(t, -1))
        return x + self.mlp(self.norm2(x))


class DecoderLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads_q: int, heads_kv: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads_q, heads_kv) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, pos, key=None, cu_seqlens=None):
        """`[tokens]` -> `[tokens, vocab]`; attention through `key` (magi) or SDPA per `cu_seqlens` document."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, pos, key, cu_seqlens)
        return self.head(self.norm(x))


def run_comparison(cfg: harness.RunConfig, group) -> list[dict]:
    from magi_attention_fsdp import dispatch_pack, fully_shard_dp_cp, init_dp_cp_mesh, pack_loss
    from torch.distributed.fsdp import MixedPrecisionPolicy

    s = cfg.shapes
    mesh = init_dp_cp_mesh(dp=1, cp=1, device_type=cfg.device.type)
    if cfg.device.type == "cuda":  # fp32 master weights, bf16 compute (FSDP2's mixed precision)
        master_dtype = torch.float32
        shard_kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=cfg.dtype, reduce_dtype=torch.float32)}
    else:
        master_dtype, shard_kwargs = cfg.dtype, {}

    def build() -> nn.Module:
        torch.manual_seed(cfg.seed)  # the same initial weights on both sides
        model = DecoderLM(s["vocab"], s["hidden"], s["layers"], s["heads_q"], s["heads_kv"])
        return fully_shard_dp_cp(model.to(device=cfg.device, dtype=master_dtype), mesh, **shard_kwargs)

    model, ref = build(), build()
    batch = harness.packed_batch(cfg.tokens, s["vocab"], seed=cfg.seed + 1, device=cfg.device)
    dist_attn_config = cfg.dist_attn_config()
    keys = []

    def magi_step() -> torch.Tensor:
        shard = dispatch_pack(
            batch.input_ids, mesh, cu_seqlens=batch.cu_seqlens, num_heads_q=s["heads_q"],
            num_heads_kv=s["heads_kv"], head_dim=s["hidden"] // s["heads_q"], dist_attn_config=dist_attn_config,
        )  # fmt: skip
        keys.append(shard.key)
        return pack_loss(model(shard.input_ids, shard.position_ids, shard.key), shard)

    def ref_step() -> torch.Tensor:
        logits = ref(batch.input_ids[0], batch.position_ids[0], cu_seqlens=batch.cu_seqlens)
        return harness.token_mean_loss(logits, batch.labels)

    magi, reference = harness.train_pair(
        model, magi_step, ref, ref_step, cfg, grad_of=lambda g: g.full_tensor()
    )
    mixed_precision = "bf16 params, fp32 reduce" if shard_kwargs else "none"
    result = harness.compare(
        NAME, cfg, batch, magi, reference, ref_label="the model's SDPA on each document", key=keys[0],
        extra={"mixed_precision": mixed_precision},
    )  # fmt: skip
    return [result]


def main(argv: list[str] | None = None) -> dict:
    return harness.main(NAME, __doc__, argv, run_comparison)


if __name__ == "__main__":
    raise SystemExit(harness.run_module(__spec__.name))
