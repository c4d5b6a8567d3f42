"""torchtitan's Trainer with magi context parallelism: each batch planned by magi and dispatched over cp.

`--parallelism.context_parallel_degree N` keeps its torchtitan meaning for the device mesh (the cp ranks of a
data-parallel replica read the same batch; FSDP shards over dp_shard x cp; the loss is reduced over both), but
torchtitan's own context parallelism (its load balancers, its wrapping of Flex / SDPA attention) is never
applied: the model spec's `parallelize_magi` skips it and `post_dataloading_process` dispatches the batch with
magi instead of sharding it. With `--magi.plan_in_dataloader` the dataloader's workers solve each batch's dispatch
ahead (`plan_in_dataloader`), so the training process only adopts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.models.common.attention import GQAttention
from torchtitan.trainer import Trainer

from magi_attention.config import DispatchAlg, DispatchConfig, DistAttnConfig

from .batch import MAGI_PREPARED, RopePositions, dispatch_batch, plan_in_dataloader

__all__ = ["MagiAttentionConfig", "MagiTrainer", "attention_shapes", "prepare_magi_input"]


@dataclass(kw_only=True, slots=True)
class MagiAttentionConfig:
    """magi-attention settings of a torchtitan run (`--magi.*` on the command line)."""

    rope_positions: RopePositions = "document"
    """RoPE positions: "document" (restart at 0 at each packed document, torchtitan's convention) or "global"
    (the token's index in its sample)."""
    chunk_size: int | None = None
    """Tokens per dispatch chunk (the unit magi balances over the cp ranks); None: magi's default. Samples
    need not be multiples of it: magi pads."""
    dispatch_alg: str | None = None
    """The placement of the tokens over the cp ranks, a `magi_attention.config.DispatchAlg` name:
    "documents" (whole documents on as few ranks as balance allows), or a chunk dispatch ("min_heap",
    "affinity", ...); None: magi chooses per batch (`DispatchConfig.alg`)."""
    plan_in_dataloader: bool = False
    """Solve each batch's dispatch (which tokens each cp rank owns) in the dataloader's worker processes,
    while the previous steps train, instead of in the training process when the batch's key is built (that
    solve takes hundreds of milliseconds per batch past a few cp ranks). Needs a torch DataLoader with
    workers (`--dataloader.num_workers 1`); see `plan_in_dataloader`."""

    def __post_init__(self) -> None:
        if self.rope_positions not in ("document", "global"):
            raise ValueError(
                f"magi.rope_positions must be 'document' or 'global', got {self.rope_positions!r}"
            )
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"magi.chunk_size must be positive or None, got {self.chunk_size}")
        valid = [a.value for a in DispatchAlg]
        if self.dispatch_alg is not None and self.dispatch_alg not in valid:
            raise ValueError(
                f"magi.dispatch_alg must be one of {', '.join(valid)} or None, got {self.dispatch_alg!r}"
            )

    def dist_attn_config(self) -> DistAttnConfig:
        """The `DistAttnConfig` these settings describe."""
        return DistAttnConfig(
            dispatch_config=DispatchConfig(chunk_size=self.chunk_size, alg=self.dispatch_alg)
        )


def attention_shapes(model_config: Any) -> tuple[int, int, int]:
    """`(num_heads_q, num_heads_kv, head_dim)` of a torchtitan decoder config whose attention is `GQAttention`."""
    attention = model_config.first_attention
    if not isinstance(attention, GQAttention.Config):
        raise TypeError(
            f"magi attention needs a model whose attention is torchtitan's GQAttention, got "
            f"{type(attention).__name__}: build the model spec with magi_model_spec"
        )
    n_kv_heads = attention.n_kv_heads or attention.n_heads
    head_dim = attention.head_dim or attention.dim // attention.n_heads
    return attention.n_heads, n_kv_heads, head_dim


def prepare_magi_input(
    input_dict: dict[str, torch.Tensor],
    labels: torch.Tensor,
    *,
    cp_mesh: Any,
    model_config: Any,
    magi_config: MagiAttentionConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Plan a dataloader batch's documents with magi and keep this cp rank's tokens, labels and positions.

    Args:
        input_dict: `{"input": [B, L], "positions": [B, L]}` from a torchtitan dataloader ("positions" optional:
            without it each sample is one document), and optionally the batch's dispatch solved ahead under
            `MAGI_PREPARED` (`plan_in_dataloader`), which `dispatch_batch` adopts.
        labels: `[B, L]` next-token targets.
        cp_mesh: the context-parallel DeviceMesh (size 1 at cp degree 1).
        model_config: the model's config (a torchtitan decoder config with `GQAttention` layers).
        magi_config: the run's magi settings.

    Returns:
        `(input_ids [1, T], labels [1, T], {"positions": [1, T], "attention_masks": MagiAttentionMask})` for this
        rank's T dispatched tokens: the arguments of the model's forward and of the loss.
    """
    other = sorted(set(input_dict) - {"input", "positions", MAGI_PREPARED})
    if other:
        raise NotImplementedError(
            f"magi dispatch takes 'input', 'positions' and {MAGI_PREPARED!r} from the dataloader, got also "
            f"{other}"
        )
    num_heads_q, num_heads_kv, head_dim = attention_shapes(model_config)
    batch = dispatch_batch(
        input_dict["input"],
        labels,
        positions=input_dict.get("positions"),
        cp_mesh=cp_mesh,
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        head_dim=head_dim,
        rope_positions=magi_config.rope_positions,
        dist_attn_config=magi_config.dist_attn_config(),
        prepared=input_dict.get(MAGI_PREPARED),
    )
    return (
        batch.input_ids,
        batch.labels,
        {"positions": batch.positions, "attention_masks": batch.attention_masks},
    )


class MagiTrainer(Trainer):
    """torchtitan `Trainer` whose batches go through magi-attention's dispatch (models from `magi_model_spec`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        magi: MagiAttentionConfig = field(default_factory=MagiAttentionConfig)
        """magi-attention settings."""

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.magi.plan_in_dataloader:
            # torchtitan builds the dataloader without the cp degree or magi's settings; it has no iterator yet,
            # so its workers pick up the planning collate from the first step on
            plan_in_dataloader(
                self.dataloader,
                cp_size=self.parallel_dims.cp,
                dist_attn_config=config.magi.dist_attn_config(),
            )

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """`prepare_magi_input` over torchtitan's cp mesh (its size-1 mesh at cp degree 1: magi then computes
        locally), in place of torchtitan's own mask building and context-parallel sharding."""
        inputs, labels, extra_kwargs = prepare_magi_input(
            input_dict,
            labels,
            cp_mesh=self.parallel_dims.get_optional_mesh("cp", include_singleton_axes=True),
            model_config=self.model_config,
            magi_config=self.config.magi,
        )
        self.ntokens_seen += labels.numel()
        return inputs, labels, extra_kwargs
