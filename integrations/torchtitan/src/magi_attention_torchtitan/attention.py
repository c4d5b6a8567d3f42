"""magi attention as torchtitan's inner attention, and the converter that puts it into a model config.

Shape legend (torchtitan's): B batch (always 1 here: the packed batch is one sequence), T this rank's tokens
(its dispatched shard), N heads, H head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common.attention import BaseAttention
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from magi_attention.api import DistAttnRuntimeKey, calc_attn

__all__ = ["MagiAttention", "MagiAttentionConverter", "MagiAttentionMask"]


@dataclass(frozen=True, slots=True)
class MagiAttentionMask:
    """What the model's `attention_masks` argument carries with magi attention: the batch's runtime key.

    The key holds the plan of the batch's packed documents over the cp group (which tokens this rank owns,
    which keys and values it fetches); every attention layer of one forward uses the same key.
    """

    key: DistAttnRuntimeKey


class MagiAttention(Module):
    """torchtitan inner attention that runs magi-attention's `calc_attn` on this rank's dispatched tokens.

    Replaces `FlexAttention` / `VarlenAttention` inside `GQAttention`: the projections, QK norm and RoPE stay
    torchtitan's; only the attention over the packed documents (causal inside each document) is magi's.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BTNH: torch.Tensor,
        k_BTNH: torch.Tensor,
        v_BTNH: torch.Tensor,
        *,
        attention_masks: MagiAttentionMask,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """Attention of this rank's queries over the keys their documents see, on every cp rank at once.

        Args:
            q_BTNH: `[1, T, num_heads_q, head_dim]` this rank's queries (after RoPE), any float dtype.
            k_BTNH, v_BTNH: `[1, T, num_heads_kv, head_dim]` this rank's keys and values (same dtype as q).
            attention_masks: the batch's `MagiAttentionMask` (built by `dispatch_batch`).
            scale: softmax scale; None: `head_dim ** -0.5`.
            enable_gqa: whether num_heads_q > num_heads_kv (torchtitan passes it; magi infers GQA from shapes).

        Returns:
            `[1, T, num_heads_q, head_dim]` in q's dtype.
        """
        if not isinstance(attention_masks, MagiAttentionMask):
            raise TypeError(
                "MagiAttention needs attention_masks=MagiAttentionMask (from dispatch_batch), got "
                f"{type(attention_masks).__name__}: train with MagiTrainer (or pass dispatch_batch's masks)"
            )
        if q_BTNH.shape[0] != 1:
            raise ValueError(
                f"MagiAttention takes the packed batch as one sequence (batch dim 1), got q of shape "
                f"{tuple(q_BTNH.shape)}: dispatch the batch with dispatch_batch"
            )
        if enable_gqa != (q_BTNH.shape[2] != k_BTNH.shape[2]):
            raise ValueError(
                f"enable_gqa={enable_gqa} but q has {q_BTNH.shape[2]} heads and k {k_BTNH.shape[2]}"
            )
        out_TNH, _ = calc_attn(
            q_BTNH[0].contiguous(),
            k_BTNH[0].contiguous(),
            v_BTNH[0].contiguous(),
            attention_masks.key,
            softmax_scale=scale,
        )
        return out_TNH.unsqueeze(0)


class MagiAttentionConverter(ModelConfigConverter):
    """Model converter: every attention layer's inner attention becomes `MagiAttention`.

    Works on any torchtitan decoder whose attention layers are `BaseAttention` configs with an
    `inner_attention` field (Llama 3, Qwen 3, ...). Use it in a model registry's `converters=[...]`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def convert(self, model_config: Module.Config) -> Module.Config:
        found = 0
        for _, attention, _, _ in model_config.traverse(BaseAttention.Config):
            attention.inner_attention = MagiAttention.Config()
            found += 1
        if found == 0:
            raise ValueError(
                f"{type(model_config).__name__} has no attention layer (BaseAttention.Config) to convert"
            )
        return model_config
