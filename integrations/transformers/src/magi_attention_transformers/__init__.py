"""Context parallelism for Hugging Face Transformers decoder models with magi-attention.

apply_magi_attention(model, cp_group)                      # once: attention + mask functions
batch = dispatch_batch(input_ids, cp_group, cu_seqlens=cu)  # per step: this rank's tokens
logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
loss = causal_lm_loss(logits, batch)                        # pack mean; backward: this rank's share
loss.backward(); all_reduce_gradients(model, cp_group)      # (or let FSDP/DDP over cp reduce them)
"""

from ._core import (
    ATTN_IMPLEMENTATION,
    DispatchedBatch,
    all_reduce_gradients,
    apply_magi_attention,
    causal_lm_loss,
    dispatch_batch,
    magi_attention_forward,
    magi_attention_mask,
    undispatch_logits,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DispatchedBatch",
    "all_reduce_gradients",
    "apply_magi_attention",
    "causal_lm_loss",
    "dispatch_batch",
    "magi_attention_forward",
    "magi_attention_mask",
    "undispatch_logits",
]
